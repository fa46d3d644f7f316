"""Timing over ranks: each iteration starts after a barrier and counts the SLOWEST rank (a TP step is
as slow as its slowest rank); modes are interleaved iteration by iteration, in a rotating order, so
background load on a shared machine hits them alike and their ratios stay meaningful."""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, TextIO

import torch
import torch.nn as nn

from ..core.blocking import all_gather_tensor, barrier
from ..core.groups import GroupLike, collective_device, is_fake, resolve_group

__all__ = ["Timing", "Progress", "estimate_line", "barrier", "time_steps", "fwd_bwd_step", "leaf", "sync"]


@dataclass
class Timing:
    """Per-iteration times (seconds, slowest rank) of one mode, and which rank was the slowest."""

    times: List[float] = field(default_factory=list)
    ranks: List[int] = field(default_factory=list)  # the slowest rank of each iteration (empty: unknown)

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
    """Progress on stderr (enabled on one rank only): a one-line bar redrawn in place on a terminal;
    elsewhere (a pipe, a CI log) whole lines, one per tenth of the work or per ``every_s`` seconds."""

    def __init__(self, total: int, label: str, enabled: bool, *, stream: Optional[TextIO] = None,
                 tty: Optional[bool] = None, every_s: float = 15.0) -> None:
        self.total, self.label, self.enabled, self.done = total, label, enabled, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self.start = self.last_line = time.perf_counter()
        self.last_tenth = 0

    def note(self, text: str) -> None:
        """One whole line (on a terminal, below the bar)."""
        if self.enabled:
            self.stream.write(("\r\033[K" if self.tty and self.done else "") + text + "\n")
            self.stream.flush()

    def step(self, n: int = 1, note: str = "") -> None:
        if not self.enabled:
            return
        self.done += n
        frac = self.done / max(1, self.total)
        now = time.perf_counter()
        elapsed = now - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        if self.tty:
            bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
            note = f"  {note[:40]:<40}" if note else ""
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s eta {eta:5.1f}s{note}")
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            tenth = int(10 * frac)
            if tenth > self.last_tenth or now - self.last_line >= self.every_s or self.done >= self.total:
                self.last_tenth, self.last_line = tenth, now
                left = "" if self.done >= self.total else f", about {_duration(eta)} left"
                self.stream.write(f"{self.label}: {self.done}/{self.total} rounds, {_duration(elapsed)}{left}"
                                  f"{'  ' + note if note else ''}\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def estimate_line(seconds: float, rounds: int, modes: int) -> str:
    """What a run will take, said before it: "about 5 min (...); `--iters N` or `--quick` to shorten"."""
    text = f"about {_duration(seconds)} ({rounds} rounds of {modes} modes, from the first round)"
    if seconds >= 30:
        text += "; `--iters N` or `--quick` to shorten"
    return text


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

    ``warmup`` untimed rounds first; a round runs every step once, each after a barrier, in an order
    rotated by one per round (no mode always follows the same one). With ``progress``, rank 0 says
    on stderr how long the whole run will take, from the first round, and how far it has got.

    Collective: every rank of ``group`` must call it with the same step names.
    """
    g = resolve_group(group)
    names = list(steps)
    rounds = warmup + iters
    local = torch.zeros(len(names), iters, dtype=torch.float64)
    bar = Progress(rounds, label, progress and g.rank == 0)
    bar.note(f"{label}: {len(names)} modes x ({warmup} warm-up + {iters} timed) rounds; timing the first round ...")
    started = time.perf_counter()
    for r in range(rounds):
        i = r - warmup  # the timed iteration (< 0: warm-up)
        for k in range(len(names)):
            j = (r + k) % len(names)  # rotate the order: no mode always follows the same one
            name = names[j]
            barrier(g)
            t0 = time.perf_counter()
            steps[name]()
            sync(device)
            if i >= 0:
                local[j, i] = time.perf_counter() - t0
        if r == 0:
            bar.note(f"{label}: " + estimate_line((time.perf_counter() - started) * rounds, rounds, len(names)))
        bar.step()
    if g.size > 1 and not is_fake(g.process_group):  # (simulated: one rank, nothing to gather)
        dev = collective_device(g.process_group)
        every = all_gather_tensor(local.to(dev)[None], 0, group=g).cpu()  # (ranks, modes, iters)
        slowest, ranks = every.max(0)
    else:
        slowest, ranks = local, torch.zeros_like(local, dtype=torch.long)
    return {name: Timing(slowest[j].tolist(), ranks[j].tolist()) for j, name in enumerate(names)}


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
