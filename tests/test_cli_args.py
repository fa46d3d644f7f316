"""The ``tplayers`` arguments: what makes a run unusable is refused before any rank starts, in one line
(exit status 2); every option has help."""
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, subprocess_env

import tplayers
from tplayers.cli import main


@pytest.mark.parametrize("argv, message", [
    (["bench", "--save", "/no/such/dir/x.json"], "--save /no/such/dir/x.json: the directory /no/such/dir does not exist"),
    (["bench", "--plot", "/no/such/p.png"], "--plot /no/such/p.png: the directory /no/such does not exist"),
    (["bench", "--trace", "/no/such/dir/trace"], "--trace /no/such/dir/trace: cannot create it"),
    (["verify", "--backend", "nccl"], "--backend nccl needs --device cuda"),
    (["bench", "--warmup", "-1"], "warmup=-1 must be >= 0"),
])
def test_unusable_arguments_fail_before_anything_runs(capsys, monkeypatch, argv, message):
    import tplayers.cli.bench_cmd as bench_cmd
    import tplayers.cli.verify as verify

    def never(*args, **kwargs):
        raise AssertionError("ranks started before the arguments were checked")

    for command in (bench_cmd, verify):  # refused up front, not after a timed run
        monkeypatch.setattr(command, "run_on_ranks", never)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1  # one line


def test_bench_outputs_that_cannot_be_written_are_refused_first(capsys, tmp_path, monkeypatch):
    for flag in ("--save", "--plot"):  # an existing directory instead of a file name
        assert main(["bench", flag, str(tmp_path)]) == 2
        assert f"{flag} {tmp_path}: is a directory" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if tplayers[plot] were not installed
    assert main(["bench", "--plot", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err == "tplayers bench: --plot needs matplotlib: pip install 'tplayers[plot]'\n"


def test_bench_save_into_a_missing_directory_fails_before_the_run(monkeypatch, capsys):
    """Checked before any rank starts: the benchmark itself is never reached (a structural check,
    not a timed one: a wall-clock bound fails on a loaded machine)."""
    import tplayers.cli.bench_cmd as bench_cmd

    def never(args):
        raise AssertionError("the benchmark ran before its output path was checked")

    monkeypatch.setattr(bench_cmd, "bench_command", never)
    assert main(["bench", "--save", "/no/such/dir/x.json"]) == 2
    assert "the directory /no/such/dir does not exist" in capsys.readouterr().err


def test_bench_save_into_a_missing_directory_fails_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "tplayers", "bench", "--save", "/no/such/dir/x.json"], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["tplayers bench: --save /no/such/dir/x.json: the directory /no/such/dir "
                                        "does not exist or is not writable"]


def test_bench_prints_its_result_before_a_write_that_fails(capsys, tmp_path, monkeypatch):
    import shutil

    import tplayers.cli.bench_cmd as bench_cmd

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run = bench_cmd.run_on_ranks

    def run_then_lose_the_directory(*args, **kwargs):
        result = run(*args, **kwargs)
        shutil.rmtree(out_dir)  # valid when checked, gone when written
        return result

    monkeypatch.setattr(bench_cmd, "run_on_ranks", run_then_lose_the_directory)
    rc = main(["bench", "--tp", "1", "--module", "column", "--batch", "1", "--seq", "4", "--hidden", "8", "--iters", "1",
               "--warmup", "0", "--modes", "tp,dense", "--no-progress", "--save", str(out_dir / "b.json")])
    captured = capsys.readouterr()
    assert rc == 1 and "TP fwd+bwd, overlap on" in captured.out  # the result is not lost
    assert captured.err.startswith("tplayers bench: could not write the result (printed above): ")
    assert captured.err.count("\n") == 1


def test_bench_bad_shape_is_a_usage_error(capsys):
    assert main(["bench", "--tp", "2", "--ffn", "15", "--iters", "1"]) == 2
    assert "ffn=15 is not divisible by the TP degree 2" in capsys.readouterr().err
    assert main(["bench", "--modes", "tp,warp", "--iters", "1"]) == 2


def test_bench_block_bad_heads_is_a_usage_error(capsys):
    assert main(["bench", "--tp", "2", "--module", "block", "--hidden", "16", "--heads", "3", "--iters", "1"]) == 2
    assert "hidden=16 is not divisible by heads=3" in capsys.readouterr().err
    assert main(["bench", "--tp", "4", "--module", "block", "--hidden", "16", "--heads", "2", "--iters", "1"]) == 2
    assert "heads=2 is not divisible by the TP degree 4" in capsys.readouterr().err


def test_bench_bad_link_is_a_usage_error(capsys):
    assert main(["bench", "--link", "warp-drive"]) == 2
    assert "link 'warp-drive': expected a preset (h100-nvlink, pcie5, ib-ndr)" in capsys.readouterr().err


def test_every_option_has_help_and_the_readme_names_the_default_shape():
    from tplayers.bench.config import SHAPES
    from tplayers.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "verify" in a.choices).choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"tplayers {name} {action.option_strings}: no help text"
    bench_default = subparsers["bench"].get_default("shape")
    readme = (ROOT / "docs" / "cli.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `--shape"))
    assert f"default {bench_default}" in row
    for name, dims in SHAPES.items():  # each named shape with its dimensions
        assert f"{name} [{dims['batch']}, {dims['seq']}, {dims['hidden']}] ffn {dims['ffn']}" in row, row


@pytest.mark.parametrize("argv", [["verify", "--timeout", "-1"], ["verify", "--timeout", "0"], ["verify", "--tp", "0"],
                                  ["bench", "--timeout", "nan"]])
def test_bad_numbers_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_refused(capsys):
    assert main(["verify", "--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_version_prints_the_package_version(capsys):
    from tplayers.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"tplayers {tplayers.__version__}"
