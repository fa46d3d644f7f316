"""Under sequence parallelism, which token order each GEMM of a column / row linear runs in: the sequence's, or
rank-major (``collectives.to_rank_major``): whichever copies fewer bytes.

Batch-first activations gathered along the sequence interleave the p ranks' chunks with the batch: every
all-gather's result reordered into ``(b, s, h)``, every reduce-scatter's input reordered out of it, is a copy of
the whole activation (b > 1). Rank-major order ``(p, b, s/p, ·)`` is the collective's own (the buffer as it lands
and as it is sent); a linear is token-wise, so its GEMMs can run there, and the reordering moves to the layer's
per-rank side: its ``out/p`` (column) or ``in/p`` (row) features. That is cheaper when that side is the narrower,
as at TP 8 (Llama-3-8B: q/k/v 768 and the MLP 3584 wide per rank against a hidden size of 4096), and dearer at
TP 2 with a wide MLP (14336 per rank), so each direction of each layer picks by its widths, counting the copies
each order makes (one per collective; in rank-major order, one per reordered tensor):

============================  =====================================  =============================================
pass                          sequence order copies                  rank-major copies
============================  =====================================  =============================================
column forward                the gathered input (in)                the output (out/p)
column backward               the re-gathered input, the input       the output gradient (out/p)
                              gradient's partial sum (2 in)
row forward                   the partial sum (out)                  the input (in/p)
row backward                  the gathered output gradient (out)     the input (for the weight gradient) and the
                                                                     input gradient (2 in/p)
============================  =====================================  =============================================

A layer's forward and backward choose independently (each backward's pairs of GEMM operands only have to agree
with each other). The regions and the block pipeline make the same choices from the same weights, so they stay
bit-identical to the two layers, except that an unchunked region with a token-wise core (an MLP's activation) keeps
its tokens rank-major from one GEMM to the other at any widths (`regions.region.keeps_rank_major`: nothing reordered
at all; equal to rounding where the layers would choose otherwise). With b = 1 both orders are the same memory and
nothing is copied. Whatever order a rank chooses, its collectives send the same buffers with the same fingerprints.

Tensors whose tokens are rank-major in the sequence's shape (:func:`in_sequence_shape`: an embedding's lookup of
reordered ids, a set's outputs kept so for a gated MLP) enter and leave the sequence-parallel region by the
differentiable :func:`reduce_scatter_rank_major` and :func:`gather_rank_major_from_sequence`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .collectives import SEQ_DIM, Pending, all_gather, from_rank_major, gather_rank_major, reduce_scatter, to_rank_major
from .groups import GroupLike, TPGroup, resolve_group

__all__ = ["rank_major_view", "in_sequence_shape", "ids_in_rank_major", "lookup_rank_major", "column_forward_rank_major",
           "column_backward_rank_major", "row_forward_rank_major", "row_backward_rank_major", "gather_sequence",
           "to_order", "to_sequence", "gathered_linear", "column_grad_order", "reduce_scatter_rank_major",
           "gather_rank_major_from_sequence"]


def rank_major_view(t: torch.Tensor, p: int) -> torch.Tensor:
    """A tensor of a sequence's shape ``(..., s, f)`` whose elements are in rank-major order (the result of
    :func:`in_sequence_shape`, or a gradient autograd computed for one) as ``(p, ..., s/p, f)``: no copy when
    contiguous."""
    return t.reshape((p,) + tuple(t.shape[:-2]) + (t.shape[-2] // p, t.shape[-1]))


def in_sequence_shape(t: torch.Tensor) -> torch.Tensor:
    """Rank-major ``(p, ..., s/p, f)`` given the sequence's shape ``(..., s, f)`` without reordering (a view): for a
    tensor whose every consumer takes the same order (a set's partial input gradient, only autograd sees it)."""
    return t.reshape(tuple(t.shape[1:-2]) + (t.shape[0] * t.shape[-2], t.shape[-1]))


def ids_in_rank_major(ids: torch.Tensor, p: int) -> torch.Tensor:
    """Token ids ``(..., s)`` in rank-major order, in their own shape (a lookup of them is :func:`in_sequence_shape`
    of the rank-major lookup): the ids are copied, b*s integers, so that the lookup is not."""
    return in_sequence_shape(to_rank_major(ids.unsqueeze(-1), p)).squeeze(-1)


def lookup_rank_major(ids: torch.Tensor, p: int) -> bool:
    """Whether a lookup of ``ids`` ``(..., s)`` to be reduce-scattered along its sequence is better made in rank-major
    order: a batch (with one sequence both orders are the same memory) and a sequence the ranks divide."""
    return p > 1 and ids.dim() >= 2 and ids.numel() > ids.shape[-1] and ids.shape[-1] % p == 0


def column_forward_rank_major(weight: torch.Tensor) -> bool:
    """A column layer's forward (``weight``: ``(out/p, in)``) runs rank-major: its output is narrower than its input."""
    return weight.shape[0] < weight.shape[1]


def column_backward_rank_major(weight: torch.Tensor) -> bool:
    """A column layer's backward runs rank-major: one ``out/p`` reorder against two ``in`` ones."""
    return weight.shape[0] < 2 * weight.shape[1]


def row_forward_rank_major(weight: torch.Tensor) -> bool:
    """A row layer's forward (``weight``: ``(out, in/p)``) runs rank-major: its input is narrower than its output."""
    return weight.shape[1] < weight.shape[0]


def row_backward_rank_major(weight: torch.Tensor) -> bool:
    """A row layer's backward runs rank-major: two ``in/p`` reorders against one ``out`` one."""
    return 2 * weight.shape[1] < weight.shape[0]


def gather_sequence(x: torch.Tensor, g: TPGroup, rank_major: bool, *, async_op: bool = False) -> Pending:
    """Every rank's sequence chunk ``x`` ``(..., s/p, f)``: ``(..., s, f)``, or rank-major ``(p, ..., s/p, f)``."""
    return gather_rank_major(x, g, async_op=async_op) if rank_major else all_gather(x, SEQ_DIM, g, async_op=async_op)


def to_order(t: torch.Tensor, g: TPGroup, rank_major: bool) -> torch.Tensor:
    """A whole sequence ``(..., s, f)`` in the order chosen (rank-major: reordered)."""
    return to_rank_major(t, g.size) if rank_major else t


def to_sequence(t: torch.Tensor, rank_major: bool) -> torch.Tensor:
    """A whole sequence in the order chosen, back to ``(..., s, f)``."""
    return from_rank_major(t) if rank_major else t


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], g: TPGroup) -> torch.Tensor:
    """A column layer's forward under SP: ``F.linear`` of every rank's chunk of ``x`` gathered, ``(..., s, out/p)``."""
    rank_major = column_forward_rank_major(weight)
    return to_sequence(F.linear(gather_sequence(x, g, rank_major).wait(), weight, bias), rank_major)


def column_grad_order(grad_out: torch.Tensor, weight: torch.Tensor, g: TPGroup) -> Tuple[bool, torch.Tensor]:
    """A column layer's backward under SP: its order (rank-major?) and its output gradient in that order."""
    rank_major = column_backward_rank_major(weight)
    return rank_major, to_order(grad_out, g, rank_major)


# ------------------------------------------------ differentiable collectives on rank-major tokens


class _ReduceScatterRankMajor(torch.autograd.Function):
    """Leave a TP region into a sequence-parallel one from ``(..., s, f)`` whose tokens are in rank-major order
    (:func:`in_sequence_shape`): the reduce-scatter's blocks as they are sent, no copy; backward all-gathers
    the gradient into that order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        ctx.g = g
        return reduce_scatter(rank_major_view(x, g.size).flatten(0, 1), 0, g).wait()  # (..., s/p, f)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherRankMajor.apply(grad, ctx.g, True), None


class _GatherRankMajor(torch.autograd.Function):
    """Every rank's sequence chunk gathered in rank-major order, as ``(..., s, f)`` (no copy); backward
    reduce-scatters a gradient in that order (``partial``: the readers are tensor-parallel), or keeps this rank's
    block of it (a complete gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup, partial: bool) -> torch.Tensor:
        ctx.g, ctx.partial = g, partial
        return in_sequence_shape(gather_rank_major(x, g).wait())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_ReduceScatterRankMajor if ctx.partial else _SplitRankMajor).apply(grad, ctx.g), None, None


class _SplitRankMajor(torch.autograd.Function):
    """This rank's block of a complete ``(..., s, f)`` whose tokens are in rank-major order; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        ctx.g = g
        return rank_major_view(x, g.size)[g.rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherRankMajor.apply(grad, ctx.g, False), None


def gather_rank_major_from_sequence(x: torch.Tensor, *, group: GroupLike, grad_is_partial: bool = True
                                    ) -> torch.Tensor:
    """Every rank's sequence chunk ``x`` ``(..., s/p, f)`` gathered in rank-major token order, in the sequence's
    shape ``(..., s, f)`` (:func:`in_sequence_shape`): the collective's own order, no copy. Backward
    reduce-scatters a gradient in that order (:func:`reduce_scatter_rank_major`), or splits it
    (``grad_is_partial=False``: replicated code reads the gathered tensor), as ``comm.gather_from_sequence``."""
    g = resolve_group(group)
    return x if g.size == 1 else _GatherRankMajor.apply(x, g, grad_is_partial)


def reduce_scatter_rank_major(x: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """``comm.reduce_scatter_to_sequence`` of ``x`` ``(..., s, f)`` (sequence dim -2) whose tokens are in rank-major
    order (a lookup made in that order: :func:`in_sequence_shape`): the collective's own order, nothing reordered
    whatever the batch. Its gradient comes back in the same order."""
    g = resolve_group(group)
    return x if g.size == 1 else _ReduceScatterRankMajor.apply(x, g)
