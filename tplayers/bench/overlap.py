"""The comm-overlap microbenchmark: what tensor parallelism costs and what comm/compute overlap hides.

Runs on every rank of a TP group (inside `tplayers.testing.World.run` or under torchrun), timed by
:mod:`tplayers.bench.timing`, reported by :mod:`tplayers.bench.report`.

`run_overlap_bench` is the comm-overlap microbenchmark behind ``tplayers bench``: for one
module (Column -> GELU -> Row MLP, a lone ColumnParallelLinear, or a whole
ParallelTransformerBlock, see :mod:`tplayers.bench.modules`) it times forward+backward
with the overlapped backward and with blocking collectives, the same collectives alone
(:mod:`tplayers.bench.schedule`), the same matmuls alone, plain dense ``torch.nn`` and naive model
parallelism (fc1 on rank 0, fc2 on rank 1). Every TP schedule's timed iterations run under comm
accounting (:mod:`tplayers.bench.measure`), so how much of its communication hid comes from the very
iterations the report times (:mod:`tplayers.bench.report` derives the headline and the fractions). Each mode is
one entry of `MODE_TABLE`: its label, how to build its step, and why it cannot run (if so).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..core.collectives import SEQ_DIM
from ..core.blocking import all_gather_tensor
from ..core.dtypes import DTYPES
from ..core.groups import GroupLike, TPGroup, collective_device, is_fake, resolve_group
from ..layers import set_overlap
from .accounting import emulated_link
from .config import MODES, BenchConfig
from .counts import count_step
from .link import calibration
from .measure import ACCOUNTING_COLUMNS, Accounted, profile, resolve_link, slowest_tflops, step_timeline
from .modules import MODULES, naive_step, tp_model
from .report import SCHEDULES, backend_name, summarize
from .schedule import comm_steps, record_collectives
from .timing import Timing, fwd_bwd_step, leaf, time_steps

__all__ = ["BenchInputs", "Mode", "MODE_TABLE", "MODE_LABELS", "run_overlap_bench"]

Step = Callable[[], None]

# ---------------------------------------------------------------------------- the modes


@dataclass
class BenchInputs:
    """What every mode's step is built from, on this rank: the dense model (seeded, the same on
    every rank) and its input and output gradient, whole and as the TP model sees them."""

    cfg: BenchConfig
    g: TPGroup
    dtype: torch.dtype
    device: torch.device
    dense: nn.Module
    x_full: torch.Tensor  # (b, s, h)
    grad_full: torch.Tensor  # (b, s, h | ffn)
    x_tp: torch.Tensor  # (b, s/p, h) under sequence parallelism
    grad_tp: torch.Tensor  # row output: replicated / seq-sharded; column output: (b, s, ffn/p)

    @classmethod
    def create(cls, g: TPGroup, cfg: BenchConfig) -> "BenchInputs":
        dtype = DTYPES[cfg.dtype]
        device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device(cfg.device)
        torch.manual_seed(cfg.seed)
        with torch.device("meta") if device.type == "meta" else contextlib.nullcontext():  # (meta: shapes only)
            dense = MODULES[cfg.module].dense(cfg).to(device, dtype)
        x_full = torch.randn(cfg.batch, cfg.seq, cfg.hidden, dtype=dtype, device=device)  # (b, s, h)
        out_dim = cfg.ffn if cfg.module == "column" else cfg.hidden
        grad_full = torch.randn(cfg.batch, cfg.seq, out_dim, dtype=dtype, device=device)  # (b, s, h|ffn)
        sp = cfg.sequence_parallel
        x_tp = g.shard(x_full, SEQ_DIM) if sp else x_full
        if cfg.module == "column":
            grad_tp = g.shard(grad_full, -1)
        else:
            grad_tp = g.shard(grad_full, SEQ_DIM) if sp else grad_full
        return cls(cfg, g, dtype, device, dense, x_full, grad_full, x_tp, grad_tp)

    def tp_step(self, model: nn.Module) -> Step:
        """One forward+backward of a TP twin of ``dense`` on this rank's input."""
        return fwd_bwd_step(model, leaf(self.x_tp), self.grad_tp.contiguous())

    @functools.cached_property
    def comm(self) -> Tuple[Step, Step]:
        """Modes comm and comm_bwd: what one overlapped TP step issues, replayed alone (recorded once)."""
        records = record_collectives(self.tp_step(tp_model(self.dense, self.cfg, self.g, True)), self.device)
        return comm_steps(records, self.cfg, self.g, self.dtype, self.device)


def _never(inputs: BenchInputs) -> Optional[str]:
    return None


@dataclass(frozen=True)
class Mode:
    """One benchmark mode: its label in the table, how to build its step, and why it cannot run
    with these inputs (None: it can)."""

    label: str
    build: Callable[[BenchInputs], Step]
    skip: Callable[[BenchInputs], Optional[str]] = _never


def _tp(overlap: bool) -> Callable[[BenchInputs], Step]:
    return lambda s: s.tp_step(tp_model(s.dense, s.cfg, s.g, overlap))


def _split(chunked: bool) -> Callable[[BenchInputs], Step]:
    return lambda s: s.tp_step(MODULES[s.cfg.module].split(s.dense, s.g, s.cfg.sequence_parallel,
                                                           s.cfg.chunks if chunked else 1))


def _split_skip(chunked: bool) -> Callable[[BenchInputs], Optional[str]]:
    def why(s: BenchInputs) -> Optional[str]:
        if MODULES[s.cfg.module].split is None:
            return "the split backward needs a column and a row layer (--module mlp or block)"
        if chunked and min(s.cfg.chunks, s.cfg.batch) < 2:
            return f"batch chunks need --batch >= 2 and --chunks >= 2 (batch {s.cfg.batch}, chunks {s.cfg.chunks})"
        return None
    return why


def _collective_matmul(s: BenchInputs) -> Step:
    model = tp_model(s.dense, s.cfg, s.g, True)
    set_overlap(model, collective_matmul=True)
    return s.tp_step(model)


def _compute(s: BenchInputs) -> Step:
    local_grad = s.g.shard(s.grad_full, -1).contiguous() if s.cfg.module == "column" else s.grad_full
    return fwd_bwd_step(MODULES[s.cfg.module].local(s.dense, s.cfg, s.g), leaf(s.x_full), local_grad)


MODE_TABLE: Dict[str, Mode] = {
    "tp": Mode("TP fwd+bwd, overlap on", _tp(True)),
    "tp_blocking": Mode("TP fwd+bwd, overlap off", _tp(False)),
    "tp_split": Mode("TP fwd+bwd, split backward", _split(False), _split_skip(False)),
    "tp_chunked": Mode("TP fwd+bwd, split bwd + batch chunks", _split(True), _split_skip(True)),
    "tp_cm": Mode("TP fwd+bwd, collective matmul (SP)", _collective_matmul,
                  lambda s: None if s.cfg.sequence_parallel and s.g.size > 1 else
                  "collective matmul decomposes sequence-parallel collectives: needs --sequence-parallel"),
    "comm": Mode("collectives alone (fwd+bwd)", lambda s: s.comm[0]),
    "comm_bwd": Mode("collectives alone (bwd, overlappable)", lambda s: s.comm[1]),
    "compute": Mode("matmuls alone (local shard)", _compute),
    "dense": Mode("dense torch.nn, one rank", lambda s: fwd_bwd_step(s.dense, leaf(s.x_full), s.grad_full)),
    "naive": Mode("naive model parallel (fc1|fc2)",
                  lambda s: naive_step(s.dense, s.cfg, s.g, leaf(s.x_full), s.grad_full),
                  lambda s: None if s.g.size == 2 and s.cfg.module == "mlp" else
                  "needs --tp 2 and --module mlp (fc1 on rank 0, fc2 on rank 1)"),
}
assert tuple(MODE_TABLE) == MODES, "bench.config.MODES names MODE_TABLE's modes in order"
MODE_LABELS: Dict[str, str] = {name: mode.label for name, mode in MODE_TABLE.items()}


# ---------------------------------------------------------------------------- the benchmark

def _slowest_rows(acc: Accounted, timing: Timing, iters: int, g: TPGroup) -> List[List[float]]:
    """The accounting row of each timed iteration from the rank that was slowest in it (collective),
    so exposure and step time describe the same rank's same iteration."""
    local = torch.tensor(acc.rows[-iters:], dtype=torch.float64).reshape(iters, len(ACCOUNTING_COLUMNS))
    if g.size == 1 or is_fake(g.process_group):
        return local.tolist()
    every = all_gather_tensor(local.to(collective_device(g.process_group))[None], 0, group=g).cpu()  # (p, iters, k)
    return [every[rank, i].tolist() for i, rank in enumerate(timing.ranks)]


def run_overlap_bench(group: GroupLike, cfg: BenchConfig) -> Dict[str, Any]:
    """The comm-overlap microbenchmark, on every rank; returns the JSON-able report (same on all ranks).

    Every TP schedule's timed iterations run under `tplayers.comm_accounting` (`measure.Accounted`):
    the exposure the report gives is that of the iterations it times."""
    g = resolve_group(group)
    cfg.check_tp(g.size)
    inputs = BenchInputs.create(g, cfg)
    raw: Dict[str, Step] = {}
    skipped: Dict[str, str] = {}
    for name in cfg.modes:
        why = MODE_TABLE[name].skip(inputs)
        if why is not None:
            skipped[name] = why
        else:
            raw[name] = MODE_TABLE[name].build(inputs)
    device = inputs.device
    accounted = {name: Accounted(raw[name], device) for name in SCHEDULES if name in raw}
    steps = {name: accounted.get(name, step) for name, step in raw.items()}

    link = resolve_link(cfg.link, g)
    calib = None
    if link is not None:  # where the link's numbers come from (and this machine's throughput, beside a match:)
        machine = (link.scaled_for_tflops if link.measured else slowest_tflops(g)) if link.preset else None
        calib = calibration(link, machine)
    with emulated_link(link) if link is not None else contextlib.nullcontext():
        timings = time_steps(steps, group=g, iters=cfg.iters, warmup=cfg.warmup, device=device,
                             progress=cfg.progress, label=f"bench {cfg.module} tp={g.size}")
        accounting = {name: {"rows": _slowest_rows(acc, timings[name], cfg.iters, g),
                             **_counts(acc)} for name, acc in accounted.items()}
        timeline = {name: step_timeline(raw[name], g, device) for name in ("tp", "tp_blocking", "tp_split",
                                                                           "tp_chunked")
                    if name in raw and g.size > 1}
    if "tp_chunked" in accounting:
        accounting["tp_chunked"]["chunks"] = min(cfg.chunks, cfg.batch)
    report = summarize(cfg, g.size, timings, skipped, backend=backend_name(g, device), accounting=accounting,
                       link=link, calibration=calib)
    report["timeline"] = timeline
    report["counts"] = {name: _steady_counts(raw[name]) for name in raw}  # what a GPU pays per step
    if cfg.trace_dir:
        traced = {MODE_LABELS[name]: raw[name] for name in ("tp", "tp_blocking") if name in raw}
        report["trace"] = profile(traced, cfg, g, device)
    return report


def _steady_counts(step: Step) -> Dict[str, Any]:
    """``step``'s counts (tplayers.bench.counts) in the steady state of these very conditions (no link, no
    accounting): one step first, so that what a first step outside them sets up (the collective checks' per-site
    buffers) is not counted."""
    step()
    return count_step(step)


def _counts(acc: Accounted) -> Dict[str, Any]:
    """The collectives of one step (the last timed one) by kind: how many, how many bytes."""
    if acc.last is None or not acc.last.records:
        return {}
    summary = acc.last.summary()
    return {"collectives_per_step": summary["counts"], "bytes_per_step": summary["bytes"]}
