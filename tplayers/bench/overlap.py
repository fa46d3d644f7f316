"""The comm-overlap microbenchmark: what tensor parallelism costs and what comm/compute overlap hides.

Runs on every rank of a TP group (inside `tplayers.testing.World.run` or under torchrun), timed by
:mod:`tplayers.bench.timing`, reported by :mod:`tplayers.bench.report`.

`run_overlap_bench` is the comm-overlap microbenchmark behind ``tplayers bench``: for one
module (Column -> GELU -> Row MLP, a lone ColumnParallelLinear, or a whole
ParallelTransformerBlock) it times forward+backward
with the overlapped backward and with blocking collectives, the same collectives alone, the
same matmuls alone, plain dense ``torch.nn`` and naive model parallelism (fc1 on rank 0, fc2 on
rank 1), and derives how much of the backward communication the overlap hides.
"""
from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .accounting import comm_accounting, emulated_link
from ..core.collectives import all_gather_tensor, all_reduce_, all_reduce_tensor, broadcast_tensor, reduce_scatter_tensor
from .link import LinkModel, matmul_tflops, parse_link
from ..core.dtypes import DTYPES
from ..core.collectives import SEQ_DIM
from ..core.groups import GroupLike, TPGroup, collective_device, resolve_group
from ..layers import ColumnParallelLinear, RowParallelLinear, set_overlap
from ..models.blocks import ParallelMLP, ParallelTransformerBlock
from ..models.dense import BlockConfig, DenseMLP, DenseTransformerBlock
from .report import backend_name, summarize
from .timing import barrier, fwd_bwd_step, leaf, sync, time_steps

__all__ = ["BenchConfig", "MODES", "MODE_LABELS", "SHAPES", "run_overlap_bench"]

MODES: Tuple[str, ...] = ("tp", "tp_blocking", "tp_split", "tp_chunked", "tp_cm", "comm", "comm_bwd", "compute",
                          "dense", "naive")
MODE_LABELS: Dict[str, str] = {
    "tp": "TP fwd+bwd, overlap on",
    "tp_split": "TP fwd+bwd, split backward",
    "tp_chunked": "TP fwd+bwd, split bwd + batch chunks",
    "tp_cm": "TP fwd+bwd, collective matmul (SP)",
    "tp_blocking": "TP fwd+bwd, overlap off",
    "comm": "collectives alone (fwd+bwd)",
    "comm_bwd": "collectives alone (bwd, overlappable)",
    "compute": "matmuls alone (local shard)",
    "dense": "dense torch.nn, one rank",
    "naive": "naive model parallel (fc1|fc2)",
}

# Named shapes: latency-bound, compute-bound, and communication-heavy (many tokens, narrow hidden).
SHAPES: Dict[str, Dict[str, int]] = {
    "small": dict(batch=1, seq=16, hidden=64, ffn=256),
    "large": dict(batch=4, seq=256, hidden=512, ffn=2048),
    "comm-heavy": dict(batch=8, seq=1024, hidden=64, ffn=256),
}

# One real model layer (implies --module block): Llama-3 8B / 70B (hidden, ffn, heads, KV heads from
# their published configs); few tokens, so one rank's compute fits this machine.
LAYER_SHAPES: Dict[str, Dict[str, Any]] = {
    "llama3-8b": dict(batch=1, seq=128, hidden=4096, ffn=14336, heads=32, kv_heads=8, activation="swiglu",
                      norm="rmsnorm"),
    "llama3-70b": dict(batch=1, seq=64, hidden=8192, ffn=28672, heads=64, kv_heads=8, activation="swiglu",
                       norm="rmsnorm"),
}

@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: module, shape ``[batch, seq, hidden]`` (ffn for the MLP and the block; heads
    for the block), precision, modes."""

    module: str = "mlp"  # "mlp" (Column -> GELU -> Row) | "column" | "block" (ParallelTransformerBlock)
    batch: int = 8
    seq: int = 1024
    hidden: int = 64
    ffn: int = 256
    heads: int = 4  # attention heads of the block (MHA, head_dim = hidden / heads)
    kv_heads: Optional[int] = None  # block: grouped-query attention (None: = heads)
    activation: str = "gelu"  # block: "gelu" | "swiglu"
    norm: str = "layernorm"  # block: "layernorm" | "rmsnorm"
    dtype: str = "float32"
    device: str = "cpu"
    sequence_parallel: bool = False
    iters: int = 50
    warmup: int = 5
    modes: Tuple[str, ...] = MODES
    seed: int = 0
    progress: bool = False
    trace_dir: Optional[str] = None
    trace_iters: int = 3
    link: Optional[str] = None  # an emulated interconnect (tplayers.bench.link spec), None: the real backend
    accounting_iters: int = 10  # overlapped iterations run again under comm_accounting (exposed comm, counts)
    chunks: int = 2  # mode tp_chunked: batch chunks (forward overlap, Domino-style)

    def __post_init__(self) -> None:
        if self.module not in _MODULES:
            raise ValueError(f"bench: unknown module {self.module!r} (choose from {sorted(_MODULES)})")
        if self.dtype not in DTYPES:
            raise ValueError(f"bench: unknown dtype {self.dtype!r} (choose from {sorted(DTYPES)})")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"bench: unknown modes {unknown} (choose from {list(MODES)})")
        for name in ("batch", "seq", "hidden", "ffn", "heads", "iters", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench: {name}={getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"bench: warmup={self.warmup} must be >= 0")
        if self.module == "block" and self.hidden % self.heads:
            raise ValueError(f"bench: hidden={self.hidden} is not divisible by heads={self.heads} (block)")
        if self.link is not None:
            try:  # the spec's syntax, now (match: measures later, on the ranks)
                parse_link(self.link, tflops=1.0)
            except ValueError as e:
                raise ValueError(f"bench: {e}") from None

    def check_tp(self, tp: int) -> None:
        """Clear errors for shapes the TP degree does not divide."""
        if self.ffn % tp:
            raise ValueError(f"bench: ffn={self.ffn} is not divisible by the TP degree {tp}")
        if self.module == "block" and self.heads % tp:
            raise ValueError(f"bench: heads={self.heads} is not divisible by the TP degree {tp} (block)")
        if self.sequence_parallel and self.seq % tp:
            raise ValueError(f"bench: seq={self.seq} is not divisible by the TP degree {tp} (sequence parallel)")


# ---------------------------------------------------------------------------- the benchmark


def _linear_shard(lin: nn.Linear, dim: int, g: TPGroup) -> nn.Linear:
    """A plain ``nn.Linear`` holding this rank's shard of ``lin`` (dim 0: column, 1: row)."""
    shape = list(lin.weight.shape)  # (out, in)
    shape[dim] //= g.size
    out = nn.Linear(shape[1], shape[0]).to(lin.weight.device, lin.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(g.shard(lin.weight, dim))
        out.bias.copy_(g.shard(lin.bias, 0) if dim == 0 else lin.bias)
    return out


def _block_config(cfg: BenchConfig) -> BlockConfig:
    return BlockConfig(hidden=cfg.hidden, n_heads=cfg.heads, ffn_hidden=cfg.ffn, n_kv_heads=cfg.kv_heads,
                       activation=cfg.activation, norm=cfg.norm)


def _local_block_config(cfg: BenchConfig, p: int) -> BlockConfig:
    """One rank's shard of the block as a plain block: its heads, KV heads (one, replicated, when
    there are fewer KV heads than ranks) and ffn slice."""
    kv = cfg.kv_heads or cfg.heads
    return replace(_block_config(cfg), n_heads=cfg.heads // p, n_kv_heads=max(1, kv // p), ffn_hidden=cfg.ffn // p,
                   head_dim=cfg.hidden // cfg.heads)


@dataclass(frozen=True)
class _Module:
    """How the benchmark builds one module kind.

    ``dense(cfg)``: the full model (random init); ``tp(dense, g, sequence_parallel)``: its TP twin
    from the same weights; ``local(dense, cfg, g)``: the TP model's computation with no
    communication (plain modules of one rank's shard shapes). Collectives: ``pairs`` column-
    parallel linears reading ``(b, s, h)``, each followed by a row-parallel one writing
    ``(b, s, h)`` when ``has_row``; the backward input-gradient collective of each column linear
    is what the overlap can hide.
    """

    dense: Callable[[BenchConfig], nn.Module]
    tp: Callable[[nn.Module, TPGroup, bool], nn.Module]
    local: Callable[[nn.Module, BenchConfig, TPGroup], nn.Module]
    pairs: int
    has_row: bool
    split: Optional[Callable[[nn.Module, TPGroup, bool, int], nn.Module]] = None  # the TP twin, split backward, k chunks


def _split_mlp(d: nn.Module, g: TPGroup, sp: bool, chunks: int) -> nn.Module:
    """The bench MLP (Linear, GELU, Linear) as a ParallelMLP with the split backward (same weights)."""
    dense = DenseMLP(d[0].in_features, d[0].out_features, "gelu", True, device=d[0].weight.device,
                     dtype=d[0].weight.dtype)
    dense.fc1.load_state_dict(d[0].state_dict())
    dense.fc2.load_state_dict(d[2].state_dict())
    return ParallelMLP.from_dense(dense, group=g, sequence_parallel=sp, split_backward=True, chunks=chunks)


def _split_block(d: nn.Module, g: TPGroup, sp: bool, chunks: int) -> nn.Module:
    block = ParallelTransformerBlock.from_dense(d, group=g, sequence_parallel=sp)
    set_overlap(block, split_backward=True, chunks=chunks)  # attention and MLP
    return block


_MODULES: Dict[str, _Module] = {
    "mlp": _Module(
        dense=lambda c: nn.Sequential(nn.Linear(c.hidden, c.ffn), nn.GELU(), nn.Linear(c.ffn, c.hidden)),
        tp=lambda d, g, sp: nn.Sequential(ColumnParallelLinear.from_dense(d[0], group=g, sequence_parallel=sp),
                                          nn.GELU(),
                                          RowParallelLinear.from_dense(d[2], group=g, sequence_parallel=sp)),
        local=lambda d, c, g: nn.Sequential(_linear_shard(d[0], 0, g), nn.GELU(), _linear_shard(d[2], 1, g)),
        pairs=1, has_row=True, split=_split_mlp),
    "column": _Module(
        dense=lambda c: nn.Linear(c.hidden, c.ffn),
        tp=lambda d, g, sp: ColumnParallelLinear.from_dense(d, group=g, sequence_parallel=sp),
        local=lambda d, c, g: _linear_shard(d, 0, g),
        pairs=1, has_row=False),
    # attention (qkv column, proj row) then MLP (fc1 column, fc2 row); local: this rank's heads and
    # ffn slice as a plain block (its own random weights: only its shapes matter for timing)
    "block": _Module(
        dense=lambda c: DenseTransformerBlock(_block_config(c)),
        tp=lambda d, g, sp: ParallelTransformerBlock.from_dense(d, group=g, sequence_parallel=sp),
        local=lambda d, c, g: DenseTransformerBlock(_local_block_config(c, g.size)).to(
            d.attn.qkv.weight.device, d.attn.qkv.weight.dtype),
        pairs=2, has_row=True, split=_split_block),
}


def _tp_model(dense: nn.Module, cfg: BenchConfig, g: TPGroup, overlap: bool) -> nn.Module:
    """The TP twin of ``dense`` with ``overlap_comm`` set on every submodule that has it."""
    model = _MODULES[cfg.module].tp(dense, g, cfg.sequence_parallel)
    set_overlap(model, overlap_comm=overlap)
    return model


def _run_all(ops: List[Callable[[], None]]) -> None:
    for op in ops:
        op()


def _comm_steps(cfg: BenchConfig, g: TPGroup, dtype: torch.dtype, device: torch.device) -> Tuple[Callable, Callable]:
    """The TP model's linear-layer collectives alone, blocking, in the order the model issues them.

    Returns (all of fwd+bwd, the backward collectives the overlap can hide). Every one moves a
    ``(b, s, h)`` activation (the input of a column linear or the output of a row linear). Not
    included: the block's norm-weight gradient all-reduces under sequence parallelism (4 x h
    values). Buffers are zeros (reducing them in place keeps them zeros: no overflow, no denormals)."""
    spec = _MODULES[cfg.module]
    b, s, h = cfg.batch, cfg.seq, cfg.hidden
    full = torch.zeros(b, s, h, dtype=dtype, device=device)  # (b, s, h)
    if cfg.sequence_parallel:
        shard = torch.zeros(b, s // g.size, h, dtype=dtype, device=device)  # (b, s/p, h)
        gather = lambda: all_gather_tensor(shard, SEQ_DIM, group=g)  # noqa: E731
        scatter = lambda: reduce_scatter_tensor(full, SEQ_DIM, group=g)  # noqa: E731
        col_fwd, row_fwd, row_bwd, col_bwd = [gather], [scatter], [gather], [gather, scatter]  # col bwd: re-gather x
    else:
        reduce = lambda: all_reduce_(full, group=g)  # noqa: E731
        col_fwd, row_fwd, row_bwd, col_bwd = [], [reduce], [], [reduce]
    if not spec.has_row:
        row_fwd = row_bwd = []
    everything = (col_fwd + row_fwd) * spec.pairs + (row_bwd + col_bwd) * spec.pairs
    return functools.partial(_run_all, everything), functools.partial(_run_all, col_bwd * spec.pairs)


def _naive_step(dense: nn.Module, cfg: BenchConfig, g: TPGroup, x: torch.Tensor,
                grad: torch.Tensor) -> Callable[[], None]:
    """fc1 (+GELU) on rank 0, fc2 on rank 1: activations and their gradient sent between them."""
    fc1, fc2 = dense[0], dense[2]
    b, s = x.shape[0], x.shape[1]
    act = torch.zeros(b, s, cfg.ffn, dtype=x.dtype, device=x.device)  # (b, s, ffn)
    mine = list((fc1 if g.rank == 0 else fc2).parameters())

    def step() -> None:
        x.grad = None
        for p in mine:
            p.grad = None
        if g.rank == 0:
            h = F.gelu(fc1(x))
            broadcast_tensor(h, 0, group=g)  # send activations to rank 1
            h.backward(broadcast_tensor(act, 1, group=g))  # receive their gradient
        else:
            h = broadcast_tensor(act, 0, group=g).requires_grad_(True)
            fc2(h).backward(grad)
            broadcast_tensor(h.grad, 1, group=g)

    return step


def run_overlap_bench(group: GroupLike, cfg: BenchConfig) -> Dict[str, Any]:
    """The comm-overlap microbenchmark, on every rank; returns the JSON-able report (same on all ranks)."""
    g = resolve_group(group)
    cfg.check_tp(g.size)
    dtype = DTYPES[cfg.dtype]
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    torch.manual_seed(cfg.seed)
    dense = _MODULES[cfg.module].dense(cfg).to(device, dtype)
    x_full = torch.randn(cfg.batch, cfg.seq, cfg.hidden, dtype=dtype, device=device)  # (b, s, h)
    out_dim = cfg.ffn if cfg.module == "column" else cfg.hidden
    grad_full = torch.randn(cfg.batch, cfg.seq, out_dim, dtype=dtype, device=device)  # (b, s, h|ffn)

    sp = cfg.sequence_parallel
    x_tp = g.shard(x_full, SEQ_DIM) if sp else x_full  # (b, s/p, h) under sequence parallelism
    if cfg.module == "column":
        grad_tp = g.shard(grad_full, -1)  # column output: (b, s, ffn/p)
    else:
        grad_tp = g.shard(grad_full, SEQ_DIM) if sp else grad_full  # row output: replicated / seq-sharded

    steps: Dict[str, Callable[[], None]] = {}
    skipped: Dict[str, str] = {}
    for mode in cfg.modes:
        if mode == "tp":
            steps[mode] = fwd_bwd_step(_tp_model(dense, cfg, g, True), leaf(x_tp), grad_tp.contiguous())
        elif mode == "tp_blocking":
            steps[mode] = fwd_bwd_step(_tp_model(dense, cfg, g, False), leaf(x_tp), grad_tp.contiguous())
        elif mode in ("tp_split", "tp_chunked"):
            split = _MODULES[cfg.module].split
            if split is None:
                skipped[mode] = "the split backward needs a column and a row layer (--module mlp or block)"
                continue
            if mode == "tp_chunked" and min(cfg.chunks, cfg.batch) < 2:
                skipped[mode] = f"batch chunks need --batch >= 2 and --chunks >= 2 (batch {cfg.batch}, chunks {cfg.chunks})"
                continue
            chunks = cfg.chunks if mode == "tp_chunked" else 1
            steps[mode] = fwd_bwd_step(split(dense, g, cfg.sequence_parallel, chunks), leaf(x_tp), grad_tp.contiguous())
        elif mode == "tp_cm":
            if not cfg.sequence_parallel or g.size == 1:
                skipped[mode] = "collective matmul decomposes sequence-parallel collectives: needs --sequence-parallel"
                continue
            model = _tp_model(dense, cfg, g, True)
            set_overlap(model, collective_matmul=True)
            steps[mode] = fwd_bwd_step(model, leaf(x_tp), grad_tp.contiguous())
        elif mode in ("comm", "comm_bwd"):
            comm_all, comm_bwd = _comm_steps(cfg, g, dtype, device)
            steps[mode] = comm_all if mode == "comm" else comm_bwd
        elif mode == "compute":
            local_grad = g.shard(grad_full, -1).contiguous() if cfg.module == "column" else grad_full
            steps[mode] = fwd_bwd_step(_MODULES[cfg.module].local(dense, cfg, g), leaf(x_full), local_grad)
        elif mode == "dense":
            steps[mode] = fwd_bwd_step(dense, leaf(x_full), grad_full)
        elif mode == "naive":
            if g.size != 2 or cfg.module != "mlp":
                skipped[mode] = "needs --tp 2 and --module mlp (fc1 on rank 0, fc2 on rank 1)"
                continue
            steps[mode] = _naive_step(dense, cfg, g, leaf(x_full), grad_full)

    link = _resolve_link(cfg.link, g)
    with emulated_link(link) if link is not None else contextlib.nullcontext():
        timings = time_steps(steps, group=g, iters=cfg.iters, warmup=cfg.warmup, device=device,
                             progress=cfg.progress, label=f"bench {cfg.module} tp={g.size}")
        measured = _account(steps.get("tp"), cfg, g, device)
        measured_split = _account(steps.get("tp_split"), cfg, g, device)
        measured_chunked = _account(steps.get("tp_chunked"), cfg, g, device)
        measured_cm = _account(steps.get("tp_cm"), cfg, g, device)
        timeline = {mode: _timeline(steps[mode], g, device) for mode in ("tp", "tp_blocking", "tp_split", "tp_chunked")
                    if mode in steps and g.size > 1}
    report = summarize(cfg, g.size, timings, skipped, backend=backend_name(g, device), measured=measured,
                       link=link)
    report["timeline"] = timeline
    if measured_split is not None:  # the same accounting for the split backward (mode tp_split)
        report["split_backward"] = measured_split
    if measured_chunked is not None:  # and for the chunked region (mode tp_chunked)
        report["chunked"] = {**measured_chunked, "chunks": min(cfg.chunks, cfg.batch)}
    if measured_cm is not None:  # and for collective matmul (mode tp_cm)
        report["collective_matmul"] = measured_cm
    if cfg.trace_dir:
        report["trace"] = _profile(steps, cfg, g, device)
    return report


def _resolve_link(spec: Optional[str], g: TPGroup) -> Optional[LinkModel]:
    """The link model every rank uses: for ``match:`` the SLOWEST rank's matmul throughput."""
    if spec is None:
        return None
    tflops = None
    if spec.strip().startswith("match:"):
        local = torch.tensor([-matmul_tflops()], dtype=torch.float64)
        tflops = -float(all_reduce_tensor(local.to(collective_device(g.process_group)), group=g, op="max"))
    return parse_link(spec, tflops=tflops)


def _account(step: Optional[Callable[[], None]], cfg: BenchConfig, g: TPGroup,
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


def _timeline(step: Callable[[], None], g: TPGroup, device: torch.device) -> Dict[str, Any]:
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


def _profile(steps: Dict[str, Callable[[], None]], cfg: BenchConfig, g: TPGroup, device: torch.device) -> str:
    """A torch.profiler trace of a few overlapped and blocking iterations (one file per rank)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    os.makedirs(cfg.trace_dir, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    path = os.path.join(cfg.trace_dir, f"bench_trace_rank{g.rank}.json")
    prof = profile(activities=activities)
    with _quiet_stderr():  # the profiler's C++ side prints "USDT: ... profiler_start/stop" lines to fd 2
        prof.start()
    try:
        for name in ("tp", "tp_blocking"):
            if name not in steps:
                continue
            for i in range(cfg.trace_iters):
                barrier(g)
                with record_function(f"{MODE_LABELS[name]} #{i}"):
                    steps[name]()
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


