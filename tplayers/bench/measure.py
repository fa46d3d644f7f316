"""What the benchmark measures beyond the timings: the link every rank emulates, the exposed
communication of every timed TP step (comm accounting, `Accounted`), one step's timeline, a profiler
trace."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from ..core.blocking import all_reduce_tensor
from ..core.groups import TPGroup, collective_device
from .accounting import comm_accounting
from .config import BenchConfig
from .link import LinkModel, matmul_tflops, parse_link
from .timing import barrier, sync


__all__ = ["resolve_link", "slowest_tflops", "ACCOUNTING_COLUMNS", "accounting_row", "Accounted", "step_timeline",
           "profile"]


def slowest_tflops(g: TPGroup) -> float:
    """This machine's float32 matmul throughput (TFLOP/s) on the SLOWEST rank of ``g`` (collective)."""
    local = torch.tensor([-matmul_tflops()], dtype=torch.float64)
    if g.size == 1:
        return -float(local)
    return -float(all_reduce_tensor(local.to(collective_device(g.process_group)), group=g, op="max"))


def resolve_link(spec: Optional[str], g: TPGroup) -> Optional[LinkModel]:
    """The link model every rank uses: for ``match:PRESET`` the SLOWEST rank's matmul throughput
    (``match:PRESET@TFLOPS`` states it: nothing measured)."""
    if spec is None:
        return None
    text = spec.strip()
    tflops = slowest_tflops(g) if text.startswith("match:") and "@" not in text else None
    return parse_link(spec, tflops=tflops)


ACCOUNTING_COLUMNS = ("exposed_fwd_ms", "exposed_bwd_ms", "in_flight_fwd_ms", "in_flight_bwd_ms")


def accounting_row(acct: Any) -> List[float]:
    """One step's comm accounting as numbers (`ACCOUNTING_COLUMNS`): the time the caller was blocked
    on each phase's collectives, and the time they were in flight (the union of their
    launch-to-completion intervals) per phase."""
    return [acct.exposed_ms("forward"), acct.exposed_ms("backward"), _duration_ms(acct, "forward"),
            _duration_ms(acct, "backward")]


class Accounted:
    """``step`` run under `comm_accounting` on every call (the timed iterations themselves, so the
    exposure and the step time come from the same iterations): `rows` holds `accounting_row` per
    call, `last` the last call's records (counts and bytes)."""

    def __init__(self, step: Callable[[], None], device: torch.device) -> None:
        self.step, self.device = step, device
        self.rows: List[List[float]] = []
        self.last: Any = None

    def __call__(self) -> None:
        with comm_accounting() as acct:
            self.step()
            sync(self.device)
        self.rows.append(accounting_row(acct))
        self.last = acct


def step_timeline(step: Callable[[], None], g: TPGroup, device: torch.device) -> Dict[str, Any]:
    """One step on this rank, as intervals (ms from the step's start): each collective's launch,
    the caller's wait and its completion, for the timeline plot."""
    barrier(g)
    with comm_accounting() as acct:
        t0 = time.perf_counter()
        step()
        sync(device)
        end = time.perf_counter()

    def ms(t: Optional[float]) -> Optional[float]:
        return None if t is None else 1e3 * (t - t0)

    return {"step_ms": ms(end), "collectives": [
        {"op": r.op, "phase": r.phase, "module": r.module, "launch_ms": ms(r.launched), "wait_ms": ms(r.wait_started),
         "end_ms": ms(r.completed)} for r in acct.records]}


def _duration_ms(acct: Any, phase: str) -> float:
    """Time the phase's collectives were in flight (ms): the union of their launch-to-completion
    intervals, so a collective queued behind another on the same link is not counted twice."""
    spans = sorted((r.launched, r.completed) for r in acct.records if r.phase == phase and r.completed is not None)
    total, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return 1e3 * total


def profile(steps: Dict[str, Callable[[], None]], cfg: "BenchConfig", g: TPGroup, device: torch.device) -> str:
    """A torch.profiler trace of ``cfg.trace_iters`` iterations of each of ``steps`` (label -> step),
    one file per rank; returns its path."""
    from torch.profiler import ProfilerActivity, profile as torch_profile, record_function

    os.makedirs(cfg.trace_dir, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    path = os.path.join(cfg.trace_dir, f"bench_trace_rank{g.rank}.json")
    prof = torch_profile(activities=activities)
    with _quiet_stderr():  # the profiler's C++ side prints "USDT: ... profiler_start/stop" lines to fd 2
        prof.start()
    try:
        for label, step in steps.items():
            for i in range(cfg.trace_iters):
                barrier(g)
                with record_function(f"{label} #{i}"):
                    step()
                    sync(device)
    finally:
        with _quiet_stderr():
            prof.stop()
    prof.export_chrome_trace(path)
    return os.path.abspath(path)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null for the block (C++ code writes there directly)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
