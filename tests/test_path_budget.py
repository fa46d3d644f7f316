"""The default Column -> Row path is readable in one sitting: a training step of a ColumnParallelLinear ->
GELU -> RowParallelLinear at TP 2 (no sequence parallelism, no siblings) runs code from at most 3 files and
at most 250 lines of functions (every line of each function it enters, docstrings included: what a reader of
the call reads). The ranks-in-step checks (on by default) stand beside the path, in their own modules."""
import os
import sys
from typing import Dict, Set, Tuple

import torch

import tplayers
from tplayers.testing import get_world

ROOT = os.path.dirname(tplayers.__file__)
PATH_FILES, PATH_LINES = 3, 250
CHECKER = {"core/fingerprint.py", "core/sites.py", "core/stamped.py", "core/carried.py", "core/digest.py"}  # the checks' own


def _trace_step(col, row, x) -> Dict[str, Set[int]]:
    """``{file under tplayers/: the lines of every function the step entered}`` for one forward + backward
    (both run on this thread: the CPU autograd engine runs a backward on its caller's)."""
    touched: Dict[str, Set[int]] = {}
    seen: Set[Tuple[str, int]] = set()

    def tracer(frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(ROOT) or (code.co_filename, code.co_firstlineno) in seen:
            return None
        seen.add((code.co_filename, code.co_firstlineno))
        lines = [line for _, _, line in code.co_lines() if line is not None]
        rel = os.path.relpath(code.co_filename, ROOT)
        touched.setdefault(rel, set()).update(range(code.co_firstlineno, max(lines) + 1))
        return None

    sys.settrace(tracer)
    try:
        row(torch.nn.functional.gelu(col(x))).sum().backward()
    finally:
        sys.settrace(None)
    return touched


def _path(group, checks: bool):
    before = tplayers.set_collective_checks(checks)
    try:
        torch.manual_seed(0)
        col = tplayers.ColumnParallelLinear(16, 32, group=group)
        row = tplayers.RowParallelLinear(32, 16, group=group)
        x = torch.randn(4, 8, 16, requires_grad=True)
        row(torch.nn.functional.gelu(col(x))).sum().backward()  # warm-up: first-call work (the checks' agreement)
        return {f: len(lines) for f, lines in _trace_step(col, row, x).items()}
    finally:
        tplayers.set_collective_checks(before[0], timeout=before[1])


def _report(files: Dict[str, int]) -> str:
    return ", ".join(f"{f} {n}" for f, n in sorted(files.items(), key=lambda kv: -kv[1]))


def test_the_column_row_path_fits_in_three_files_and_250_lines():
    files = get_world(2).run(_path, False)[0]
    assert len(files) <= PATH_FILES and sum(files.values()) <= PATH_LINES, (
        f"the Column -> Row path touches {len(files)} files, {sum(files.values())} lines: {_report(files)}")


def test_the_collective_checks_stand_beside_the_path():
    off = get_world(2).run(_path, False)[0]
    on = get_world(2).run(_path, True)[0]
    assert set(on) - set(off) <= CHECKER, f"checks on adds {sorted(set(on) - set(off) - CHECKER)} to the path"
    assert {f: n for f, n in on.items() if f not in CHECKER} == off, (
        f"the checks change the path itself: on {_report(on)}; off {_report(off)}")
