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


# ------------------------------------------------------------------ what the docs promise around the blocks

NAMED_FILE = re.compile(r"\b(?:examples|docs|benchmarks|tests|tplayers)/[\w./-]+\.(?:py|md|png|json)\b")


def test_files_the_docs_name_exist():
    """A path the README or a doc points the reader to (an example, another doc) is in the tree."""
    missing = {f"{path.relative_to(ROOT)}: {name}" for path in [*DOCS, ROOT / "CONTRIBUTING.md"]
               for name in NAMED_FILE.findall(path.read_text()) if not (ROOT / name).exists()}
    assert not missing, sorted(missing)


def test_readme_links_every_doc():
    """Every page under docs/ is reachable from the README's documentation table."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Documentation"):]
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"](docs/{p.name})" not in table]
    assert not unlinked, f"add these to the README's Documentation table: {unlinked}"


def test_gpu_quickstart_is_a_tested_program():
    """docs/gpu.md's program is the GPU recipe (set_device, NCCL, the launch-order variable, bf16 with
    main_grad) and runs as a whole through test_doc_block_runs_as_shown: on the CPU path (gloo) here."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    programs = [m.group(1) for m in BLOCK.finditer(text) if RUN.match(m.group(1).splitlines()[0])]
    assert any(p.startswith("# run: torchrun") for p in programs), "docs/gpu.md needs a '# run: torchrun' program"
    program = next(p for p in programs if p.startswith("# run: torchrun"))
    for needed in ("torch.cuda.set_device(local_rank)", '"nccl"', '"gloo"', "CUDA_DEVICE_MAX_CONNECTIONS",
                   "tplayers.use_main_grad(", "tplayers.main_grads_to_grads(", "tplayers.zero_main_grads(",
                   "torch.bfloat16"):
        assert needed in program, f"docs/gpu.md's program does not show {needed}"


def _install_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Install"):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_readme_install_says_cpu_and_gpu_and_keeps_ci_s_lines():
    """The README's Install block gives a CPU-only command and a GPU one, and every install line CI
    runs (.ci/run) is in it as written there (CI runs the README's commands that work on its machine)."""
    block = _install_block()
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    cpu = [c for c in commands if "--index-url https://download.pytorch.org/whl/cpu" in c]
    assert cpu == ["pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"], commands
    comments = {line.split("#", 1)[0].strip(): line.split("#", 1)[1] for line in block.splitlines() if "#" in line}
    assert "CPU" in comments[cpu[0]], "say which line is for a CPU-only machine"
    assert any("GPU" in c for c in comments.values()), "say which line is for a GPU machine"
    ci = (ROOT / ".ci" / "run").read_text()
    ci_installs = [line.strip().replace("python -m pip", "pip", 1) for line in ci.splitlines()
                   if line.strip().startswith("python -m pip install")]
    assert ci_installs, ".ci/run installs nothing?"
    for line in ci_installs:
        assert line in commands, f".ci/run runs {line!r}, which the README's Install does not show"


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_generated_from_the_current_code():
    """docs/api.md is what docs/gen_api.py makes of the code now (signatures, first paragraphs)."""
    want = _gen_api().render()
    assert (ROOT / "docs" / "api.md").read_text() == want, "docs/api.md is out of date: run python docs/gen_api.py"


def test_api_reference_documents_every_public_name():
    """Every name in tplayers.__all__ and in each documented subpackage's __all__ is in its section of
    docs/api.md, with a docstring (or, for data, a comment in the code)."""
    gen = _gen_api()
    text = (ROOT / "docs" / "api.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    by_module = {s.split("\n", 1)[0].strip("` "): s for s in sections}
    assert [m for m, _ in gen.SECTIONS] == list(by_module)
    assert gen.SECTIONS[0][0] == "tplayers"
    for module, _ in gen.SECTIONS:
        names = importlib.import_module(module).__all__
        missing = [n for n in names if f"`{n}`" not in by_module[module] and f"`{module}.{n}`" not in by_module[module]]
        assert not missing, f"{module}: not in docs/api.md: {missing}"
    assert "(no docstring)" not in text and "(no comment in the code)" not in text
