"""What the benchmark measures beyond the timings: the link every rank emulates, the exposed
communication of an overlapped step (comm accounting), one step's timeline, a profiler trace."""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional

import torch

from ..core.collectives import all_reduce_tensor
from ..core.groups import TPGroup, collective_device
from .accounting import comm_accounting
from .link import LinkModel, matmul_tflops, parse_link
from .timing import barrier, sync

if TYPE_CHECKING:  # (overlap.py imports this module)
    from .overlap import BenchConfig

__all__ = ["resolve_link", "account", "step_timeline", "profile"]


def resolve_link(spec: Optional[str], g: TPGroup) -> Optional[LinkModel]:
    """The link model every rank uses: for ``match:`` the SLOWEST rank's matmul throughput."""
    if spec is None:
        return None
    tflops = None
    if spec.strip().startswith("match:"):
        local = torch.tensor([-matmul_tflops()], dtype=torch.float64)
        tflops = -float(all_reduce_tensor(local.to(collective_device(g.process_group)), group=g, op="max"))
    return parse_link(spec, tflops=tflops)


def account(step: Optional[Callable[[], None]], cfg: "BenchConfig", g: TPGroup,
            device: torch.device) -> Optional[Dict[str, Any]]:
    """Run the overlapped step ``cfg.accounting_iters`` more times under comm_accounting: the
    exposed (blocked) communication per step, measured, and the collectives of one step."""
    if step is None or cfg.accounting_iters < 1 or g.size == 1:
        return None
    rows = []  # per step: exposed total / fwd / bwd, and the collectives' own durations fwd / bwd (ms)
    for _ in range(cfg.accounting_iters):
        barrier(g)
        with comm_accounting() as acct:
            step()
            sync(device)
        rows.append([acct.exposed_ms(), acct.exposed_ms("forward"), acct.exposed_ms("backward"),
                     _duration_ms(acct, "forward"), _duration_ms(acct, "backward")])
    # the slowest rank's median, as for the timings
    local = torch.tensor([statistics.median(col) for col in zip(*rows)], dtype=torch.float64)
    worst = all_reduce_tensor(local.to(collective_device(g.process_group)), group=g, op="max").cpu().tolist()

    def hidden(exposed: float, duration: float) -> Optional[float]:
        return None if duration <= 0 else 1.0 - exposed / duration

    return {"exposed_comm_ms": worst[0], "exposed_comm_fwd_ms": worst[1], "exposed_comm_bwd_ms": worst[2],
            "forward_hidden_fraction": hidden(worst[1], worst[3]),
            "backward_hidden_fraction_measured": hidden(worst[2], worst[4]),
            "collectives_per_step": acct.summary()["counts"], "bytes_per_step": acct.summary()["bytes"]}


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
