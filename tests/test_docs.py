"""Every Python block in README.md and docs/*.md runs as its first line says.

The first line of a block is its launch command, shown to the reader too:
``# run: python NAME.py`` or ``# run: torchrun --nproc-per-node N NAME.py`` (the block is saved as
NAME.py in a fresh directory and run there; torchrun gets a free port), or
``# fragment: why`` for a piece of a larger program (skipped, by name). A run must exit 0 and
print something; a ```console block right after it that starts with ``$ <the launch command>``
is the output it must print (line order free: ranks interleave). Under torchrun the ranks' output is
collected with ``--tee 1`` (torchrun copies each rank's lines whole, prefixed ``[defaultN]:``, which
is stripped): two ranks printing at once into one pipe can otherwise splice one rank's line into
another's before its newline.
"""
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from _helpers import _free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```\n", re.M | re.S)
SHOWN = re.compile(r"\s*```console\n\$ (.*?)\n(.*?)^```", re.M | re.S)
RUN = re.compile(r"# run: (python|torchrun --nproc-per-node (\d+)) ([\w-]+\.py)$")
TEE_PREFIX = re.compile(r"^\[\w+\]:")  # torchrun --tee: each rank's lines, whole, after "[default0]:"
OPTIONAL = {"transformers": "hf", "lightning": "lightning", "safetensors": "hf"}


def _blocks():
    for path in DOCS:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text[: m.start()].count("\n") + 1
            shown = SHOWN.match(text, m.end())
            yield pytest.param(m.group(1), shown and (shown.group(1), shown.group(2)),
                               id=f"{path.relative_to(ROOT)}:{line}")


def test_docs_have_python_blocks():
    assert len(list(_blocks())) >= 8  # the parser itself works (README + docs/)


@pytest.mark.parametrize("code, shown", list(_blocks()))
def test_doc_block_runs_as_shown(code, shown, tmp_path):
    first = code.splitlines()[0]
    if first.startswith("# fragment: "):
        pytest.skip(first)
    run = RUN.match(first)
    assert run, (f"first line must be '# run: python NAME.py', '# run: torchrun --nproc-per-node N NAME.py' "
                 f"or '# fragment: why'; got {first!r}")
    for module, extra in OPTIONAL.items():
        if re.search(rf"^\s*(from|import) {module}\b", code, re.M) and importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install -e '.[{extra}]')")
    launch, nproc, name = run.groups()
    (tmp_path / name).write_text(code)
    if nproc is None:
        cmd = [sys.executable, name]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc,
               "--master-port", str(_free_port()), "--tee", "1", "--log-dir", str(tmp_path / "torchrun-logs"), name]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{launch} {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    out = proc.stdout if nproc is None else "\n".join(TEE_PREFIX.sub("", line) for line in proc.stdout.splitlines())
    assert out.strip(), f"{launch} {name} printed nothing"
    if shown is not None and shown[0] == f"{launch} {name}":
        assert sorted(out.strip().splitlines()) == sorted(shown[1].strip().splitlines()), proc.stdout
