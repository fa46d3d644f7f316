"""Column -> core -> row as one region: both layers' backward ordered together, batch chunks in flight.

Two separate layers (:mod:`.functional`) hide the column layer's input-gradient collective under the
column layer's weight gradient only: the row layer's weight gradient ran earlier, with nothing in
flight. As one autograd Function the region runs the input-gradient chain first (row, core, column),
launches the column layer's collective, and computes BOTH layers' weight gradients under it::

    Two layers                                One region (split backward)
    row:    grad_a = grad_y @ W2              grad_a = grad_y @ W2; grad_h = core'(grad_a)
            grad_W2 = grad_y^T @ a            grad_x = grad_h @ W1; pending = all_reduce(grad_x)
    column: grad_x = grad_h @ W1              grad_W2 = grad_y^T @ a       # under the all-reduce
            pending = all_reduce(grad_x)      grad_W1 = grad_h^T @ x       # under the all-reduce
            grad_W1 = grad_h^T @ x            grad_x = pending.wait()
            grad_x = pending.wait()

Same ops, new order: the same numbers bit for bit (under sequence parallelism an unchunked region with a token-wise
core keeps its tokens rank-major, :func:`keeps_rank_major`: equal to the two layers to rounding where they would
reorder them). ``split_backward=False`` keeps the two layers' order, for that token order alone. ``chunks > 1``
(Domino-style forward overlap) splits the batch: forward launches each chunk's row collective as soon as it exists,
so it travels while the next chunk computes; backward likewise each chunk's input-gradient collective.

The kit the region and the block pipeline (:mod:`.interleave`) share: `batch_chunks` / `cat_rows`
(chunking), `core_graph` (the core's autograd graph for a hand-ordered backward).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..core.collectives import sum_partials
from ..core.seq_order import (column_backward_rank_major, column_forward_rank_major, gather_sequence,
                              row_backward_rank_major, row_forward_rank_major, to_order, to_sequence)
from ..core.ring import ring_gather_linear, ring_linear_scatter
from ..core.functional import (autocast_dtype, check_linear_inputs, column_parallel_linear, row_parallel_linear,
                               warn_cuda_connections_once)
from ..core.graph import differentiable_grads
from ..core.groups import GroupLike, TPGroup, resolve_group
from ..core.wgrad import MainGrads, WeightGradStore, WgradSink, check_main_grads, chunked_wgrads, region_wgrads

__all__ = ["split_backward_region", "parallel_mlp", "batch_chunks", "cat_rows", "into_rows", "chunk_pairs", "core_graph",
           "core_vjp", "keeps_core_graph",
           "Core", "require_chunks", "stays_rank_major", "keeps_rank_major"]

Core = Callable[[torch.Tensor, slice], torch.Tensor]  # (this rank's (bc, s, width) columns, batch rows) -> row input


def require_chunks(chunks: int, where: str) -> int:
    """``chunks``, or a ValueError naming ``where`` unless it is an integer >= 1."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{where}: chunks must be an integer >= 1, got {chunks!r}")
    return chunks


def batch_chunks(batch: int, chunks: int) -> List[slice]:
    """``chunks`` contiguous row ranges covering ``range(batch)`` (fewer when the batch is smaller)."""
    n = max(1, min(chunks, batch))
    bounds = [batch * i // n for i in range(n + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def cat_rows(parts: List[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Batch chunks back into one tensor (the batch dim: 0, or 1 for rank-major ``(p, b, s/p, f)``)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def stays_rank_major(sequence_parallel: bool, token_wise: bool, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether a column -> core -> row region over batch chunks keeps its tokens in rank-major order from the column
    layer's GEMM to the row layer's, both ways, never reordering them: under sequence parallelism, with a token-wise
    core (an MLP's activation), when each of the two layers' four passes would choose that order anyway
    (core/seq_order.py). Then every GEMM sees the same operands in the same order as the two layers do (the same
    bits), and the per-rank side is never copied (at TP 8 on a Llama-3 MLP: three activations' worth per step).
    Elsewhere the chunks' per-rank sides, joined for the weight gradients, would cost more (one chunk:
    :func:`keeps_rank_major`)."""
    return sequence_parallel and token_wise and column_forward_rank_major(w1) and row_backward_rank_major(w2)


def keeps_rank_major(sequence_parallel: bool, token_wise: bool, w1: torch.Tensor, w2: torch.Tensor,
                     chunks: int) -> bool:
    """Whether a region keeps its tokens rank-major from one GEMM to the other. One chunk, under sequence parallelism,
    a token-wise core: always, at any widths; nothing between the two GEMMs is then reordered, which copies less
    than any order the two layers would choose one pass at a time (TP 4 on a Llama-3 MLP: 4.6 activations per step
    fewer). Where each of their passes would choose rank-major anyway (:func:`stays_rank_major`) the bits are the
    two layers'; elsewhere the results equal theirs to rounding (the GEMMs see the tokens in another order).
    Chunks: :func:`stays_rank_major`."""
    return sequence_parallel and token_wise and (chunks == 1 or stays_rank_major(True, True, w1, w2))


def into_rows(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``a @ b`` written into ``rows`` (contiguous batch rows of a whole tensor): a chunk's result in place, so the
    chunks need no concatenation."""
    return torch.matmul(a, b, out=rows)


def chunk_pairs(whole: torch.Tensor, chunks: List[torch.Tensor], rows: List[slice], rank_major: bool
                ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """``whole`` and ``chunks`` (its batch chunks' partners) as pieces paired chunk by chunk for the weight
    gradients (`chunked_wgrads`): ``whole``'s batch rows are views; rank-major (the batch in dim 1) they are not,
    so the (per-rank, narrower) chunks are joined instead."""
    if rank_major:
        return [whole], [cat_rows(chunks, 1)]
    return [whole[r] for r in rows], chunks


def core_vjp(core: Core, h: torch.Tensor, rows: slice, grad_a: torch.Tensor,
             graph: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(core(h), the gradient at h)`` for ``grad_a`` at the core's output: by the core's own ``vjp(h, grad_a)``
    where it has one (no nested backward, a Python engine call per chunk), else through its autograd graph
    (``graph``, kept from forward; else recomputed)."""
    if graph is None and hasattr(core, "vjp"):
        return core.vjp(h, grad_a)
    h_in, a = core_graph(core, h, rows) if graph is None else graph
    (grad_h,) = torch.autograd.grad(a, h_in, grad_a)  # (bc, s, local column width), or rank-major
    return a.detach(), grad_h


def keeps_core_graph(recompute: bool) -> bool:
    """Whether a region keeps its core's autograd graph from forward (``recompute=False``) now: not while saved-tensor
    hooks are active (activation checkpointing, offloading). Their placeholders, unpacked by the nested backward
    through that graph (a graph task of its own), would make a non-reentrant checkpoint run its forward again (and an
    ``RNGTracker.checkpoint``'s single-use contexts raise); the core is then recomputed in backward instead."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return not recompute and (top is None or top(False) is None)


def core_graph(core: Core, h: torch.Tensor, rows: slice) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(h_in, core(h_in, rows))`` with the core's autograd graph from a detached copy ``h_in`` of
    ``h``, for ``torch.autograd.grad`` in a hand-ordered backward (kept from forward: no second SDPA)."""
    with torch.enable_grad():
        h_in = h.detach().requires_grad_()
        return h_in, core(h_in, rows)


class _SplitBackwardFn(torch.autograd.Function):
    """The region of the module docstring. ``recompute``: the core runs again in backward (cheap
    activations: its output is not kept); otherwise its autograd graph from forward is kept."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, core: Core, g: TPGroup, sequence_parallel: bool, overlap_comm: bool,
                recompute: bool, rows: List[slice], sink: WgradSink, stay: bool, split: bool, ring: bool):
        sp, chunked = sequence_parallel, len(rows) > 1
        # SP: rank-major throughout (stay: keeps_rank_major), or each GEMM in the token order the two layers would
        # choose (core/seq_order.py), so the same bits
        rm1 = sp and (stay or ring or column_forward_rank_major(w1))
        rm2 = sp and (stay or ring or row_forward_rank_major(w2))
        gathers = [gather_sequence(x[rows[0]], g, rm1, async_op=chunked)] if sp and not ring else []
        summed = x.new_empty(x.shape[:-1] + w2.shape[:1]) if chunked and not sp else None  # each chunk's rows of it
        hs, graphs, reducing = [], [], []
        recompute = not keeps_core_graph(recompute)
        for i, r in enumerate(rows):
            if sp and i + 1 < len(rows):  # the next chunk's input travels while this one computes
                gathers.append(gather_sequence(x[rows[i + 1]], g, rm1, async_op=True))
            if ring:  # (one chunk) the gather in p ring steps under the GEMMs, each writing its rank's block
                h = ring_gather_linear(x, w1, b1, g, rank_major=True)  # (p, b, s/p, local column width)
            else:
                x_full = gathers[i].wait() if sp else x[r]  # (bc, s, hidden) or rank-major (p, bc, s/p, hidden)
                h = F.linear(x_full, w1, b1)  # (bc, s, local column width), or rank-major
            h = h if stay else to_sequence(h, rm1)
            if recompute:
                a = core(h, r)
            else:
                h_in, a = core_graph(core, h, r)
                graphs.append((h_in, a))
                a = a.detach()
            a = a if stay else to_order(a, g, rm2)
            if ring:  # the reduce-scatter in p ring steps under the GEMMs
                summed = ring_linear_scatter(a, w2, g)  # (b, s/p, hidden)
            else:
                partial = F.linear(a, w2) if summed is None else into_rows(a, w2.t(), summed[r])
                reducing.append(sum_partials(partial, g, sp, async_op=chunked, rank_major=rm2))  # this rank's share
            hs.append(h)
        sums = [pending.wait() for pending in reducing]
        out = cat_rows(sums) if summed is None else summed  # (b, s | s/p, hidden)
        if b2 is not None:
            out = out.add_(b2)
        ctx.save_for_backward(x, w1, b1, w2, b2, *hs)
        ctx.graphs = graphs or None  # autograd graphs (their tensors saved through autograd), not tensors
        ctx.core, ctx.g, ctx.sequence_parallel, ctx.overlap_comm, ctx.rows, ctx.sink = core, g, sp, overlap_comm, rows, sink
        ctx.stay, ctx.split, ctx.ring = stay, split, ring
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: rebuilt from the differentiable layers
            ctx.graphs = None
            return (*_split_graph_grads(ctx, grad_out), None, None, None, None, None, None, None, None, None, None)
        x, w1, b1, w2, b2, *hs = ctx.saved_tensors
        g, sp, overlap_comm, rows, sink = ctx.g, ctx.sequence_parallel, ctx.overlap_comm, ctx.rows, ctx.sink
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        # SP: each GEMM in the token order the two layers would choose (core/seq_order.py), so the same bits
        rm1 = sp and (ctx.stay or column_backward_rank_major(w1))
        rm2 = sp and (ctx.stay or ctx.ring or row_backward_rank_major(w2))
        if ctx.ring:  # (one chunk) the gather in p ring steps, each block's GEMM under the next block's transfer
            grad_full = grad_out.new_empty((g.size,) + grad_out.shape)  # (p, b, s/p, hidden), filled by the ring
            grad_a_full = ring_gather_linear(grad_out, w2.t(), None, g, gathered=grad_full, rank_major=True)
        else:
            grad_full = gather_sequence(grad_out, g, rm2).wait() if sp else grad_out  # (b, s, hidden) | (p, b, s/p, ..)
        x_full = sink.input(x, need_w1, async_op=overlap_comm)  # SP: in flight under the chain below
        if not ctx.ring:
            grad_a_full = grad_full @ w2 if rm2 else None  # rank-major: one GEMM for every chunk
        graphs, ctx.graphs = ctx.graphs, None
        grad_x = grad_out.new_empty(x.shape) if need_x and len(rows) > 1 and not sp else None  # chunks' rows of it
        grad_hs, acts, reducing = [], [], []

        def launch(grad_h: torch.Tensor, r: slice):  # a chunk's partial input gradient (a buffer we own), at once
            partial = grad_h @ w1 if grad_x is None else into_rows(grad_h, w1, grad_x[r])
            return sum_partials(partial, g, sp, async_op=overlap_comm, rank_major=rm1)
        for i, (r, h) in enumerate(zip(rows, hs)):  # the input-gradient chain, chunk by chunk
            grad_a = grad_full[r] @ w2 if not rm2 else grad_a_full[:, r] if ctx.stay else to_sequence(grad_a_full[:, r], True)
            a, grad_h = core_vjp(ctx.core, h, r, grad_a, None if graphs is None else graphs[i])
            grad_h = grad_h if ctx.stay else to_order(grad_h, g, rm1)
            grad_hs.append(grad_h)
            acts.append(a if ctx.stay else to_order(a, g, rm2))
            if need_x and ctx.split:  # this chunk's input gradient travels while the next chunk's chain runs
                reducing.append(launch(grad_h, r))
        needs = (need_w1, need_b1 and b1 is not None, need_w2, need_b2 and b2 is not None)
        grad_fulls, acts = chunk_pairs(grad_full, acts, rows, rm2)
        row_grads: Tuple[Optional[torch.Tensor], ...] = (None, None)
        if not ctx.split:  # the two layers' order: the row layer's weight gradients, then the column's collective
            if sink.store is None:  # (recorded ones run later anyway: routed with the column's below)
                main = None if sink.main is None else sink.main[2:]
                row_grads = chunked_wgrads(grad_fulls, acts, needs[2], needs[3], main, g)
                needs = needs[:2] + (False, False)
            reducing = [launch(grad_hs[0], rows[0])] if need_x else []

        def column():  # the column layer's input, asked for once the row layer's GEMMs are queued
            xs, grads_h = chunk_pairs(sink.whole(x_full), grad_hs, rows, rm1)
            return grads_h, xs
        grads = sink.route(needs, lambda: region_wgrads((grad_fulls, acts), column, needs, sink.main, g))
        grads = (*grads[:2], *(mine if mine is not None else routed for mine, routed in zip(row_grads, grads[2:])))
        sums = [pending.wait() for pending in reducing]
        grad_x = (cat_rows(sums) if grad_x is None else grad_x) if need_x else None
        return (grad_x, *grads, None, None, None, None, None, None, None, None, None, None)


def _split_graph_grads(ctx, grad_out):
    """create_graph=True: the same region through the differentiable column / row ops, unchunked (the
    core runs again: callers keep dropout out of split regions)."""
    g, sp = ctx.g, ctx.sequence_parallel

    def forward(x, w1, b1, w2, b2):
        h = column_parallel_linear(x, w1, b1, group=g, sequence_parallel=sp)
        return row_parallel_linear(ctx.core(h, slice(None)), w2, b2, group=g, sequence_parallel=sp)

    return differentiable_grads(forward, ctx.saved_tensors[:5], ctx.needs_input_grad[:5], grad_out)


def split_backward_region(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
                          b2: Optional[torch.Tensor], core: Core, *, group: GroupLike, sequence_parallel: bool = False,
                          overlap_comm: bool = True, recompute: bool = False, chunks: int = 1,
                          wgrad_store: Optional[WeightGradStore] = None, main_grads: MainGrads = None,
                          token_wise: bool = False, split_backward: bool = True,
                          collective_matmul: bool = False) -> torch.Tensor:
    """``row(core(column(x)))`` with the split backward of the module docstring. ``core(h, rows)``
    maps this rank's ``(bc, s, local width)`` columns of the batch rows ``rows`` (a slice of dim 0) to
    the row layer's ``(bc, s, local width)`` input; it must not mix ranks nor draw random numbers.
    ``chunks > 1``: the batch runs in that many chunks (fewer if the batch is smaller); results equal
    the unchunked path up to rounding. Shapes as :func:`column_parallel_linear` (``w1``) then
    :func:`row_parallel_linear` (``w2``); ``x`` is ``(b, s, hidden)`` (``(b, s/p, hidden)`` with
    ``sequence_parallel``). ``wgrad_store``: backward computes the input-gradient chain only and records
    the four weight and bias gradients there; ``main_grads``: the four buffers for w1, b1, w2, b2 (as
    :func:`column_parallel_linear`'s). ``token_wise``: ``core`` acts on each token alone (an MLP's activation):
    under sequence parallelism the tokens then stay in rank-major order from one GEMM to the other
    (:func:`keeps_rank_major`). ``split_backward=False``: backward in the two layers' own (Megatron's) order, the row
    layer's weight gradients before the column layer's collective (one chunk only): what the region keeps is the token
    order. ``collective_matmul`` (sequence parallel, one chunk): forward's gather and reduce-scatter and backward's
    gather of the output gradient in p ring steps under the GEMMs, as the layers' own. Under autocast, or in a world
    of one, it composes the two layers instead."""
    g = resolve_group(group)
    require_chunks(chunks, "split_backward_region")
    if chunks > 1 and not split_backward:
        raise ValueError(f"split_backward_region: chunks={chunks} needs split_backward=True (each chunk's "
                         "input-gradient collective runs under the next chunk's backward)")
    if collective_matmul and (chunks > 1 or not sequence_parallel):
        raise ValueError(f"split_backward_region: collective_matmul needs sequence_parallel=True and one chunk "
                         f"(got sequence_parallel={sequence_parallel}, chunks={chunks})")
    check_linear_inputs("split_backward_region", x, w1, b1, w1.shape[1], g, sequence_parallel)
    if g.size == 1 or autocast_dtype(x) is not None:
        h = column_parallel_linear(x, w1, b1, group=g, sequence_parallel=sequence_parallel, overlap_comm=overlap_comm,
                                   wgrad_store=wgrad_store, main_grads=None if main_grads is None else main_grads[:2],
                                   collective_matmul=collective_matmul)
        return row_parallel_linear(core(h, slice(None)), w2, b2, group=g, sequence_parallel=sequence_parallel,
                                   wgrad_store=wgrad_store, main_grads=None if main_grads is None else main_grads[2:],
                                   collective_matmul=collective_matmul)
    if chunks > 1 and x.dim() < 3:
        raise ValueError(f"split_backward_region: chunks={chunks} splits the batch dim of a (b, s, hidden) input, "
                         f"got shape {tuple(x.shape)}")
    warn_cuda_connections_once(x, g, overlap_comm)
    rows = batch_chunks(x.shape[0], chunks) if x.dim() >= 3 else [slice(None)]
    stay = keeps_rank_major(sequence_parallel, token_wise, w1, w2, len(rows))
    sink = WgradSink(g, wgrad_store, check_region_main_grads(main_grads, w1, b1, w2, b2, "split_backward_region", g),
                     (w1, b1, w2, b2), gather_input=sequence_parallel,
                     rank_major=sequence_parallel and (stay or column_backward_rank_major(w1)))
    return _SplitBackwardFn.apply(x, w1, b1, w2, b2, core, g, sequence_parallel, overlap_comm, recompute, rows, sink,
                                  stay, split_backward, collective_matmul)


def check_region_main_grads(main_grads: MainGrads, w1, b1, w2, b2, op: str, g: TPGroup) -> MainGrads:
    """A region's four main_grad buffers (w1, b1, w2, b2) checked against its parameters, or None."""
    if main_grads is None:
        return None
    return (*check_main_grads(main_grads[:2], w1, b1, op, g.size), *check_main_grads(main_grads[2:], w2, b2, op, g.size))


def parallel_mlp(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
                 b2: Optional[torch.Tensor], act: Callable[[torch.Tensor], torch.Tensor], *, group: GroupLike,
                 sequence_parallel: bool = False, overlap_comm: bool = True, chunks: int = 1,
                 wgrad_store: Optional[WeightGradStore] = None, main_grads: MainGrads = None) -> torch.Tensor:
    """An MLP ``row(act(column(x)))`` with the split backward (:func:`split_backward_region`); the
    activation is recomputed in backward, so the row layer's input is not kept. ``act`` maps this
    rank's ``(..., ffn/p)`` columns (SwiGLU: its local ``[gate_r; up_r]``). ``chunks``: forward overlap
    over batch chunks; ``wgrad_store``: weight gradients recorded for later; ``main_grads``: the four
    accumulation buffers; all as in :func:`split_backward_region`."""
    return split_backward_region(x, w1, b1, w2, b2, lambda h, rows: act(h), group=group,
                                 sequence_parallel=sequence_parallel, overlap_comm=overlap_comm, recompute=True,
                                 chunks=chunks, wgrad_store=wgrad_store, main_grads=main_grads, token_wise=True)
