"""The commands' stdout: a reader that goes away (``tplayers verify --json | head -1``) is not an error."""
from __future__ import annotations

import os
import sys

__all__ = ["print_out", "flush_stdout", "stdout_gone"]


def stdout_gone() -> None:
    """The reader of stdout went away (``tplayers verify --json | head -1``): as CLIs do, say nothing
    more there. Later writes, and the interpreter's final flush, go to /dev/null instead of raising."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_gone()


def print_out(text: str) -> None:
    """``print`` for the command's output: a closed stdout is not an error (the run's exit status stands)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        stdout_gone()
