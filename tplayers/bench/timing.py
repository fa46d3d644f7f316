"""Timing over ranks: each iteration starts after a barrier and counts the SLOWEST rank (a TP step is
as slow as its slowest rank); modes are interleaved iteration by iteration, in a rotating order, so
background load on a shared machine hits them alike and their ratios stay meaningful."""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List

import torch
import torch.nn as nn

from ..core.collectives import all_gather_tensor, barrier
from ..core.groups import GroupLike, collective_device, is_fake, resolve_group

__all__ = ["Timing", "Progress", "barrier", "time_steps", "fwd_bwd_step", "leaf", "sync"]


@dataclass
class Timing:
    """Per-iteration times (seconds, slowest rank) of one mode."""

    times: List[float] = field(default_factory=list)

    @property
    def min_ms(self) -> float:
        return 1e3 * min(self.times)

    @property
    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.times)

    def as_dict(self) -> Dict[str, float]:
        return {"min_ms": self.min_ms, "median_ms": self.median_ms,
                "mean_ms": 1e3 * statistics.fmean(self.times), "n": len(self.times)}


# ---------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    """Wait for queued GPU work (timing must include it); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Progress:
    """A one-line progress bar on stderr (enabled on one rank only)."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled, self.done = total, label, enabled, 0
        self.start = time.perf_counter()

    def step(self, n: int = 1, note: str = "") -> None:
        if not self.enabled:
            return
        self.done += n
        frac = self.done / max(1, self.total)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        note = f"  {note[:40]:<40}" if note else ""
        sys.stderr.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s{note}")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def time_steps(
    steps: Dict[str, Callable[[], None]],
    *,
    group: GroupLike,
    iters: int,
    warmup: int,
    device: torch.device = torch.device("cpu"),
    progress: bool = False,
    label: str = "bench",
) -> Dict[str, Timing]:
    """Time each step ``iters`` times, interleaved; per iteration the slowest rank's time.

    Collective: every rank of ``group`` must call it with the same step names.
    """
    g = resolve_group(group)
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
        sync(device)
    local = torch.zeros(len(names), iters, dtype=torch.float64)
    bar = Progress(iters, label, progress and g.rank == 0)
    for i in range(iters):
        for k in range(len(names)):
            j = (i + k) % len(names)  # rotate the order: no mode always follows the same one
            name = names[j]
            barrier(g)
            t0 = time.perf_counter()
            steps[name]()
            sync(device)
            local[j, i] = time.perf_counter() - t0
        bar.step()
    if g.size > 1 and not is_fake(g.process_group):  # (simulated: one rank, nothing to gather)
        dev = collective_device(g.process_group)
        slowest = all_gather_tensor(local.to(dev)[None], 0, group=g).amax(0).cpu()  # (modes, iters)
    else:
        slowest = local
    return {name: Timing(slowest[j].tolist()) for j, name in enumerate(names)}


def leaf(x: torch.Tensor) -> torch.Tensor:
    """A fresh leaf copy of ``x`` that requires grad (the input of a timed step)."""
    return x.detach().clone().requires_grad_(True)


def fwd_bwd_step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """A step timing one forward+backward of ``model`` on the leaf ``x`` with output grad ``grad``."""
    params = [p for p in model.parameters()]

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        model(x).backward(grad)

    return step
