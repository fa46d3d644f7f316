"""Regenerate the pictures and sample outputs of README.md and docs/ from the commands printed with them.

    python docs/figures.py             # every figure (a few minutes: the bench figures are real timed runs)
    python docs/figures.py --list      # each figure: its name, the doc that shows it, its command
    python docs/figures.py bench ...   # only the named figures

Each figure is one entry of `FIGURES`: the docs that show it, its command (printed in those docs
verbatim, so a reader can run exactly what made it) and what the command makes:

- a picture: the command ends in ``--plot PATH`` and writes PATH (``docs/NAME.png``), which the docs
  show as ``![...](...NAME.png)``;
- a sample output: the lines under ``$ COMMAND`` in a ```console block of the doc, up to the next
  ``$`` line or the block's end, are replaced by what the command prints (and the comment after the
  command says when and where it ran).

The commands run from the repository root as ``python -m tplayers ...`` (this checkout first on
PYTHONPATH). ``tests/test_figures.py`` keeps this honest without drawing anything: every command is
still printed in its docs, still parses, and still runs in a tiny form (`tiny_argv`); every picture
the docs show is made by a figure here.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Figure:
    """One picture or sample output, the command that makes it, and the docs that show it."""

    name: str
    command: str  # as printed in the docs, starting with "tplayers "
    docs: Tuple[str, ...]  # paths from the repository root
    sample: bool = False  # True: a console sample under "$ COMMAND" in docs[0]; False: a picture (--plot)

    @property
    def argv(self) -> List[str]:
        words = shlex.split(self.command)
        assert words[0] == "tplayers", self.command
        return words[1:]

    @property
    def picture(self) -> Optional[str]:
        """The PNG the command writes (its --plot argument), or None for a sample output."""
        argv = self.argv
        return argv[argv.index("--plot") + 1] if "--plot" in argv else None


FIGURES: Tuple[Figure, ...] = (
    Figure("verify", "tplayers verify", ("docs/cli.md",), sample=True),
    Figure("verify-own-model",
           "tplayers verify --model examples.own_model:build --plan examples.own_model:PLAN --tp 1,2,4",
           ("docs/cli.md",), sample=True),
    Figure("bench", "tplayers bench", ("docs/cli.md",), sample=True),
    Figure("bench-budget", "tplayers bench --module hf:llama", ("docs/cli.md",), sample=True),
    Figure("bench-budget-sp", "tplayers bench --module hf:llama --sequence-parallel --loss-parallel", ("docs/cli.md",),
           sample=True),
    Figure("bench-timeline",
           "tplayers bench --module block --batch 2 --seq 256 --hidden 256 --ffn 1024 --heads 8 --iters 20 "
           "--link 0.02/20 --plot docs/bench_timeline.png", ("docs/cli.md", "README.md")),
    Figure("overlap-modes",
           "tplayers bench --module block --chunks 4 --iters 10 --modes tp,tp_blocking,tp_split,tp_chunked,comm,compute "
           "--plot docs/overlap_modes.png", ("README.md",)),
)

# A tiny form of each kind of command, for tests/test_figures.py: the same options, small enough to run in seconds.
TINY_BENCH = ["--batch", "2", "--seq", "8", "--hidden", "16", "--ffn", "32", "--heads", "2", "--iters", "1",
              "--warmup", "0", "--no-progress"]


def tiny_argv(figure: Figure, plot: Optional[str] = None) -> List[str]:
    """``figure``'s arguments in a tiny form (a later option wins in argparse): the bench on a tiny
    shape for one iteration (``--plot`` to ``plot``), verify on a few checks at TP 2."""
    argv = list(figure.argv)
    if figure.picture is not None and plot is not None:
        argv[argv.index("--plot") + 1] = plot
    if argv[0] == "bench":
        return argv + TINY_BENCH
    if argv[0] == "verify":
        return argv + ["--tp", "2"] + ([] if "--model" in argv else ["-k", "Column->GELU->Row MLP"])
    raise ValueError(f"no tiny form for {figure.command!r}")


def counts_only(figure: Figure) -> bool:
    """A bench figure that counts collectives against their budget (``--module hf:FAMILY``): nothing timed."""
    argv = figure.argv
    return "--module" in argv and argv[argv.index("--module") + 1].startswith("hf:")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):  # not under a launcher
        env.pop(var, None)
    return env


def console_block_lines(text: str, command: str) -> Tuple[int, int]:
    """The line range [start, end) of the sample output under ``$ command`` (an optional ``# comment``
    after it) in a ```console block of ``text``: from the line after it to the next ``$`` line or the
    block's end."""
    lines = text.split("\n")
    pattern = re.compile(r"^\$ " + re.escape(command) + r"(\s+#.*)?$")
    inside = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            inside = line.strip() == "```console"
            continue
        if inside and pattern.match(line):
            end = i + 1
            while end < len(lines) and not lines[end].startswith("$ ") and not lines[end].startswith("```"):
                end += 1
            return i + 1, end
    raise LookupError(f"no '$ {command}' line in a console block")


def _stamp() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"# docs/figures.py, {_dt.date.today().isoformat()}, {os.cpu_count()}-core {os.uname().machine} "
            f"machine, load average {load:.1f}")


def regenerate(figure: Figure) -> None:
    """Run ``figure``'s command from the repository root; write its picture, or its sample output into its doc."""
    print(f"== {figure.name}: {figure.command}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, "-m", "tplayers", *figure.argv], cwd=ROOT, env=_env(),
                          stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{figure.name}: `{figure.command}` exited {proc.returncode}")
    if not figure.sample:
        print(f"   wrote {figure.picture}", file=sys.stderr)
        return
    path = ROOT / figure.docs[0]
    text = path.read_text()
    start, end = console_block_lines(text, figure.command)
    lines = text.split("\n")
    out = proc.stdout.rstrip("\n").split("\n")
    if figure.argv[0] == "bench" and not counts_only(figure):  # timings: say when and where they were taken
        lines[start - 1] = f"$ {figure.command}    {_stamp()}"
    lines[start:end] = out
    path.write_text("\n".join(lines))
    print(f"   wrote {len(out)} lines into {figure.docs[0]}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="only these figures (default: all)")
    parser.add_argument("--list", action="store_true", help="list the figures and their commands")
    args = parser.parse_args(argv)
    known = {f.name: f for f in FIGURES}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown figures {unknown}; known: {', '.join(known)}")
    chosen = [known[n] for n in args.names] if args.names else list(FIGURES)
    if args.list:
        for f in chosen:
            print(f"{f.name:<18} {'sample' if f.sample else 'picture'} in {', '.join(f.docs)}: {f.command}")
        return 0
    for f in chosen:
        regenerate(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
