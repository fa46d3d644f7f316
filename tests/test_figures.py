"""docs/figures.py regenerates every picture and sample output of the docs from the command printed with
it: each command is still printed in its docs, still parses, and still runs in a tiny form (the
pictures themselves are not compared: they hold timings)."""
import importlib.util
import re
import sys

import pytest

from conftest import ROOT

from tplayers.cli import build_parser, main

_spec = importlib.util.spec_from_file_location("figures", ROOT / "docs" / "figures.py")
figures = sys.modules["figures"] = importlib.util.module_from_spec(_spec)  # (dataclasses look it up there)
_spec.loader.exec_module(figures)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _flat(text):
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("figure", figures.FIGURES, ids=lambda f: f.name)
def test_figure_command_is_printed_in_its_docs_and_parses(figure):
    for doc in figure.docs:
        text = (ROOT / doc).read_text()
        if figure.sample:
            start, end = figures.console_block_lines(text, figure.command)  # the sample under "$ COMMAND"
            assert end > start, f"{doc}: no output under '$ {figure.command}'"
        else:
            assert f"`{figure.command}`" in text, f"{doc} does not print the command of {figure.picture}"
            assert re.search(r"!\[[^\]]*\]\((docs/)?" + re.escape(figure.picture.split("/")[-1]) + r"\)", text), doc
    build_parser().parse_args(figure.argv)
    build_parser().parse_args(figures.tiny_argv(figure, "x.png"))


def test_every_picture_the_docs_show_is_a_figure():
    made = {f.picture.split("/")[-1] for f in figures.FIGURES if f.picture}
    for doc in DOCS:
        for name in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", doc.read_text()):
            assert name.split("/")[-1] in made, f"{doc.name} shows {name}, which no figure in docs/figures.py makes"


@pytest.mark.parametrize("figure", figures.FIGURES, ids=lambda f: f.name)
def test_figure_command_runs_in_a_tiny_form(figure, tmp_path, capsys):
    plot = str(tmp_path / "p.png")
    if figure.picture is not None and importlib.util.find_spec("matplotlib") is None:
        pytest.skip("--plot needs matplotlib (pip install -e '.[plot]')")
    if figures.counts_only(figure) and importlib.util.find_spec("transformers") is None:
        pytest.skip("--module hf: needs transformers (pip install -e '.[hf]')")
    assert main(figures.tiny_argv(figure, plot)) == 0
    out = capsys.readouterr().out
    if figure.argv[0] == "verify":
        assert "checks passed" in out
    else:
        assert ("measured vs Megatron-layout budget" in out) if figures.counts_only(figure) else ("headline:" in out)
    if figure.picture is not None:
        assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_console_block_lines_finds_the_output_under_its_command():
    text = "x\n```console\n$ pip install .\n$ tplayers bench    # a note\na\nb\n$ echo $?\n0\n```\n"
    assert figures.console_block_lines(text, "tplayers bench") == (4, 6)
    with pytest.raises(LookupError):
        figures.console_block_lines("```python\n$ tplayers bench\n```\n", "tplayers bench")
