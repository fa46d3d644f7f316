"""Block-level interleave: a pre-norm residual stack of split regions over batch chunks, as one pipeline.

A pre-norm block is a stack of regions ``y = y + row(core(column(norm(y))))`` (attention, then the
MLP). Chunked one region at a time (`split_backward_region(chunks=k)`), a region waits for all its
chunks' collectives before it returns, so the last chunk's collective of each region travels with
nothing to hide under: 2 of the block's 2k forward collectives are exposed whatever the link. Batch
chunks are independent through the whole block, so here a stage (region j, chunk i) waits only for
its own chunk's collective from region j-1 (A = attention, B = MLP)::

    forward    A0 A1 ... A(k-1)  B0 B1 ... B(k-1)      B0 waits for A0 only: A(k-1) travels under B0

and only the last stage's collective is left exposed (1 of R*k). Backward is the mirror image: the
last region's input-gradient chains chunk by chunk, each chunk's collective launched at once; that
region's weight gradients (all chunks, one GEMM per weight) under its last collectives; then the
region before, whose stage i waits only for chunk i's collective, and so on, the first region's
collectives under its own weight gradients. Same numbers as the unchunked block up to summation
order. (A software-pipeline order, A0 A1 B0 A2 B1 ..., measured the same within noise on the CPU
emulation and is harder to follow.)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..core.collectives import Pending, all_reduce, sum_partials
from ..core.seq_order import (column_backward_rank_major, column_forward_rank_major, gather_sequence,
                              row_backward_rank_major, row_forward_rank_major, to_order, to_sequence)
from ..core.comm import copy_to_tp
from ..core.functional import column_parallel_linear, row_parallel_linear, warn_cuda_connections_once
from ..core.graph import differentiable_grads
from ..core.groups import TPGroup
from .region import (Core, batch_chunks, cat_rows, check_region_main_grads, chunk_pairs, core_graph, core_vjp,
                     keeps_core_graph, stays_rank_major)
from ..core.wgrad import MainGrads, WeightGradStore, WgradSink, region_wgrads

__all__ = ["ResidualRegion", "interleaved_residual_regions"]

Norm = Callable[[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class ResidualRegion:
    """One ``y + row(core(column(norm(y))))`` of a pre-norm block. ``norm(y, weight, bias)`` must not
    communicate (under sequence parallelism the norm parameters' gradients are summed over the group
    here, once); ``w1``..``core``/``recompute`` as `split_backward_region`; ``wgrad_store`` /
    ``main_grads`` where the four linear weight gradients go (as there)."""

    norm: Norm
    norm_weight: Optional[torch.Tensor]
    norm_bias: Optional[torch.Tensor]
    w1: torch.Tensor
    b1: Optional[torch.Tensor]
    w2: torch.Tensor
    b2: Optional[torch.Tensor]
    core: Core
    recompute: bool = False
    token_wise: bool = False  # core acts on each token alone (an MLP's activation): see region.stays_rank_major
    wgrad_store: Optional[WeightGradStore] = None
    main_grads: MainGrads = None

    def tensors(self) -> Tuple[Optional[torch.Tensor], ...]:
        return (self.norm_weight, self.norm_bias, self.w1, self.b1, self.w2, self.b2)


_PER_REGION = 6  # norm weight, norm bias, w1, b1, w2, b2


@dataclass(frozen=True)
class _Schedule:
    regions: Tuple[ResidualRegion, ...]
    g: TPGroup
    sequence_parallel: bool
    overlap_comm: bool
    rows: Tuple[slice, ...]


def _stages(regions: int, chunks: int) -> List[Tuple[int, int]]:
    """``(region, chunk)`` in issue order: region by region, each over its chunks (backward: reversed
    regions). What makes it a pipeline is that a stage waits only for its own chunk's collective."""
    return [(j, i) for j in range(regions) for i in range(chunks)]


def _with_bias(reduced: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return reduced if bias is None else reduced.add_(bias)  # as the row layer: the full bias once, after the sum


class _InterleavedBlockFn(torch.autograd.Function):
    """The pipeline of the module docstring as one Function, so that its backward follows it too.
    (One Function per chunk with deferred waits would pipeline the forward only: the autograd engine
    runs the newest ready node first, so each backward wait would run right after its own launch.)"""

    @staticmethod
    def forward(ctx, x, schedule: _Schedule, *tensors):
        g, sp, rows, regions = schedule.g, schedule.sequence_parallel, schedule.rows, schedule.regions
        n_regions, k = len(regions), len(rows)
        params = [tensors[_PER_REGION * j:_PER_REGION * (j + 1)] for j in range(n_regions)]
        ys = [[None] * n_regions for _ in rows]  # region j's input (the residual stream), chunk i
        ns, hs, graphs = ([[None] * n_regions for _ in rows] for _ in range(3))
        pending: List[List[Optional[Pending]]] = [[None] * n_regions for _ in rows]
        resid = [x[r] for r in rows]  # (bc, s | s/p, hidden)
        for j, i in _stages(n_regions, k):
            region, (nw, nb, w1, b1, w2, _) = regions[j], params[j]
            y = resid[i]
            if j > 0:  # this chunk's collective from the previous region traveled under the stages since
                y = y + _with_bias(pending[i][j - 1].wait(), params[j - 1][5])
                pending[i][j - 1] = None
            n = region.norm(y, nw, nb)
            # SP: each GEMM in the token order the two layers would choose (core/seq_order.py), so the same bits
            rm1, rm2 = sp and column_forward_rank_major(w1), sp and row_forward_rank_major(w2)
            stay = stays_rank_major(sp, region.token_wise, w1, w2)
            n_full = gather_sequence(n, g, rm1).wait() if sp else n  # (bc, s, hidden) or (p, bc, s/p, hidden)
            h = F.linear(n_full, w1, b1)  # (bc, s, local column width), or rank-major
            h = h if stay else to_sequence(h, rm1)
            if not keeps_core_graph(region.recompute):  # (see keeps_core_graph: recomputed in backward)
                a = region.core(h, rows[i])
            else:
                h_in, a = graphs[i][j] = core_graph(region.core, h, rows[i])
                a = a.detach()
            partial = F.linear(a if stay else to_order(a, g, rm2), w2)  # this rank's share
            pending[i][j] = sum_partials(partial, g, sp, async_op=True, rank_major=rm2)  # in flight
            ys[i][j], ns[i][j], hs[i][j], resid[i] = y, n, h, y
        last_bias = params[-1][5]
        out = x.new_empty(x.shape)  # each chunk's rows written in place: no concatenation
        for i, r in enumerate(rows):
            torch.add(resid[i], _with_bias(pending[i][-1].wait(), last_bias), out=out[r])
        kept = [t for stage in (ys, ns, hs) for chunk in stage for t in chunk]  # (3, k, regions), flattened
        ctx.save_for_backward(x, *tensors, *kept)
        ctx.schedule, ctx.graphs = schedule, graphs  # graphs: autograd's (their tensors saved through it)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: rebuild the block from the differentiable layers
            return _graph_backward(ctx, grad_out)
        return _BlockBackward(ctx, grad_out).run()


class _BlockBackward:
    """The backward of `_InterleavedBlockFn`: regions last to first, chunk by chunk (module docstring)."""

    def __init__(self, ctx, grad_out: torch.Tensor) -> None:
        s = ctx.schedule
        self.graphs, ctx.graphs = ctx.graphs, None
        self.g, self.sp, self.rows, self.regions, self.overlap_comm = (s.g, s.sequence_parallel, s.rows, s.regions,
                                                                       s.overlap_comm)
        n, k = self.n_regions, self.k = len(self.regions), len(self.rows)
        self.needs_x = ctx.needs_input_grad[0]
        _, tensors, self.ys, self.ns, self.hs = _unpack(ctx.saved_tensors, n, k)
        self.params = [tensors[_PER_REGION * j:_PER_REGION * (j + 1)] for j in range(n)]
        self.needs = [ctx.needs_input_grad[2 + _PER_REGION * j:2 + _PER_REGION * (j + 1)] for j in range(n)]
        self.grad_resid = [grad_out[r] for r in self.rows]  # the gradient of region j's output, chunk i
        self.grad_x = grad_out.new_empty(grad_out.shape) if self.needs_x else None  # filled chunk by chunk
        self.gfs, self.acts, self.grad_hs = ([[None] * n for _ in range(k)] for _ in range(3))
        self.pending: List[List[Optional[Pending]]] = [[None] * n for _ in range(k)]
        self.norm_grads: List[List[Optional[torch.Tensor]]] = [[None, None] for _ in range(n)]
        self.grads: List[Optional[torch.Tensor]] = [None] * (_PER_REGION * n)

    def run(self):
        g, sp, n, k = self.g, self.sp, self.n_regions, self.k
        # region 0's input-gradient collective and norm backward feed only x's and its norm's gradients
        chain_to_x = self.needs_x or any(self.needs[0][:2])
        for q, i in _stages(n, k):
            j = n - 1 - q  # backward runs the regions last to first
            if j + 1 < n:
                self.through_norm(i, j + 1)
            region, (_, _, w1, _, w2, _) = self.regions[j], self.params[j]
            # SP: each GEMM in the token order the two layers would choose (core/seq_order.py), so the same bits
            rm1, rm2 = self.rank_major(j)
            gf = gather_sequence(self.grad_resid[i], g, rm2).wait() if sp else self.grad_resid[i]  # (bc, s, hidden)
            graph = None if self.graphs is None else self.graphs[i][j]  # None: the core recomputed (core_vjp)
            stay = stays_rank_major(sp, region.token_wise, w1, w2)
            grad_a = gf @ w2 if stay else to_sequence(gf @ w2, rm2)
            a, grad_h = core_vjp(region.core, self.hs[i][j], self.rows[i], grad_a, graph)  # (bc, s, width)
            grad_h = grad_h if stay else to_order(grad_h, g, rm1)
            a = a if stay else to_order(a, g, rm2)
            self.gfs[i][j], self.acts[i][j], self.grad_hs[i][j] = gf, a, grad_h
            if j > 0 or chain_to_x:  # this chunk's partial input gradient (a buffer we own) travels at once
                self.pending[i][j] = sum_partials(grad_h @ w1, g, sp, async_op=self.overlap_comm, rank_major=rm1)
            if i == k - 1:  # region j's last stage: its weight gradients now, under its last collectives
                self.weight_grads(j)
        if chain_to_x:
            for i in range(k):
                self.through_norm(i, 0)
        for j in range(n):  # norm parameters: each chunk's share summed; under SP over the group too
            for slot in (0, 1):
                grad = self.norm_grads[j][slot]
                if grad is not None and sp:
                    grad = all_reduce(grad.contiguous(), g).wait()
                self.grads[_PER_REGION * j + slot] = grad
        return (self.grad_x, None, *self.grads)

    def rank_major(self, j: int) -> Tuple[bool, bool]:
        """Region j's backward token orders under SP (column, row): core/seq_order.py's choices."""
        w1, w2 = self.params[j][2], self.params[j][4]
        return self.sp and column_backward_rank_major(w1), self.sp and row_backward_rank_major(w2)

    def through_norm(self, i: int, j: int) -> None:
        """Region j's input-gradient collective for chunk i has arrived: through its norm, into the residual."""
        grad_n = self.pending[i][j].wait()
        self.pending[i][j] = None
        nw, nb = self.params[j][0], self.params[j][1]
        with torch.enable_grad():
            y_in = self.ys[i][j].detach().requires_grad_()
            leaves = [None if t is None or not need else t.detach().requires_grad_()
                      for t, need in zip((nw, nb), self.needs[j][:2])]
            n = self.regions[j].norm(y_in, *(t if leaf is None else leaf for t, leaf in zip((nw, nb), leaves)))
            wanted = [y_in] + [leaf for leaf in leaves if leaf is not None]
            grad_y, *grad_norm = torch.autograd.grad(n, wanted, grad_n)
        # y feeds both the norm and the skip connection; region 0's sum is x's gradient, written in its rows
        out = self.grad_x[self.rows[i]] if j == 0 and self.grad_x is not None else None
        self.grad_resid[i] = torch.add(self.grad_resid[i], grad_y, out=out)
        got, sums = iter(grad_norm), self.norm_grads[j]
        for slot, leaf in enumerate(leaves):
            if leaf is not None:
                grad = next(got)
                sums[slot] = grad if sums[slot] is None else sums[slot] + grad

    def weight_grads(self, j: int) -> None:
        """Region j's four weight gradients over all chunks (one GEMM each), under its last collectives
        (or recorded for backward_dw: delay_wgrad)."""
        region, (_, _, w1, b1, w2, b2) = self.regions[j], self.params[j]
        need_w1, need_b1, need_w2, need_b2 = self.needs[j][2:]
        needs = (need_w1, need_b1 and b1 is not None, need_w2, need_b2 and b2 is not None)
        rm1, rm2 = self.rank_major(j)
        # chunk by chunk (chunked_wgrads: no concatenation), each chunk's row-layer pair in one order
        gfs, acts = ([t[i][j] for i in range(self.k)] for t in (self.gfs, self.acts))
        grad_hs, ns = ([t[i][j] for i in range(self.k)] for t in (self.grad_hs, self.ns))
        sink = WgradSink(self.g, region.wgrad_store, region.main_grads, (w1, b1, w2, b2), gather_input=self.sp,
                         rank_major=rm1)
        # SP: the norm's output shards gathered once for every chunk (under the row layer's GEMMs)
        n_full = sink.input(cat_rows(ns), need_w1, async_op=self.overlap_comm) if self.sp else None

        def column():  # the column layer's gradients and whole inputs, chunk by chunk
            if not self.sp:
                return grad_hs, ns
            xs, grads_h = chunk_pairs(sink.whole(n_full), grad_hs, list(self.rows), rm1)
            return grads_h, xs
        base = _PER_REGION * j
        self.grads[base + 2:base + 6] = sink.route(needs, lambda: region_wgrads(
            (gfs, acts), column, needs, region.main_grads, self.g))


def _unpack(saved, n_regions: int, k: int):
    """``ctx.saved_tensors`` back into ``x``, the regions' tensors, and ys, ns, hs as ``[chunk][region]``."""
    tensors, kept = saved[1:1 + _PER_REGION * n_regions], saved[1 + _PER_REGION * n_regions:]
    ys, ns, hs = ([[kept[(stage * k + i) * n_regions + j] for j in range(n_regions)] for i in range(k)]
                  for stage in range(3))
    return saved[0], tensors, ys, ns, hs


def _graph_backward(ctx, grad_out):
    """create_graph=True: the block through the differentiable column / row ops, unchunked, and its
    gradient (each core runs again: callers keep dropout out of interleaved blocks)."""
    schedule, ctx.graphs = ctx.schedule, None
    g, sp = schedule.g, schedule.sequence_parallel
    x, tensors, *_ = _unpack(ctx.saved_tensors, len(schedule.regions), len(schedule.rows))

    def forward(y, *tensors):
        for j, region in enumerate(schedule.regions):
            nw, nb, w1, b1, w2, b2 = tensors[_PER_REGION * j:_PER_REGION * (j + 1)]
            if sp:  # each rank normalized its own tokens: the norm parameters' gradients summed over the group
                nw, nb = (None if t is None else copy_to_tp(t, group=g) for t in (nw, nb))
            h = column_parallel_linear(region.norm(y, nw, nb), w1, b1, group=g, sequence_parallel=sp)
            y = y + row_parallel_linear(region.core(h, slice(None)), w2, b2, group=g, sequence_parallel=sp)
        return y

    needs = (ctx.needs_input_grad[0], *ctx.needs_input_grad[2:])
    grads = differentiable_grads(forward, (x, *tensors), needs, grad_out)
    return (grads[0], None, *grads[1:])


def interleaved_residual_regions(x: torch.Tensor, regions: Sequence[ResidualRegion], *, group: TPGroup,
                                 chunks: int, sequence_parallel: bool = False,
                                 overlap_comm: bool = True) -> torch.Tensor:
    """``x`` through ``y = y + row(core(column(norm(y))))`` for each region in turn, run over ``chunks``
    batch chunks as the pipeline of the module docstring. ``x``: ``(b, s, hidden)``, ``(b, s/p,
    hidden)`` with ``sequence_parallel``; the output has its shape. ``overlap_comm=False``: the
    backward's collectives block (the same order). Callers fall back to the regions one by one
    where this does not apply (a world of one, autocast, dropout, a KV cache)."""
    if x.dim() != 3:
        raise ValueError(f"interleaved_residual_regions: expected (batch, seq, hidden), got {tuple(x.shape)}")
    regions = tuple(region if region.main_grads is None else replace(region, main_grads=check_region_main_grads(
        region.main_grads, region.w1, region.b1, region.w2, region.b2, "interleaved_residual_regions", group))
        for region in regions)
    warn_cuda_connections_once(x, group, overlap_comm)
    schedule = _Schedule(regions, group, sequence_parallel, overlap_comm, tuple(batch_chunks(x.shape[0], chunks)))
    tensors = [t for region in regions for t in region.tensors()]
    return _InterleavedBlockFn.apply(x, schedule, *tensors)
