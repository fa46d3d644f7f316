"""Differentiable collectives over a TP group: the paper's f and g, and their sequence twins.

Three tiers, as in Megatron-core: core's primitives (``all_reduce`` ..., in :mod:`.collectives`)
that return a `Pending` handle so callers can overlap them with compute; private autograd
Functions; public snake_case wrappers. The non-differentiable helpers (``all_gather_tensor`` ...)
live in :mod:`.blocking`, the token-dispatch rows in :mod:`.rows`. Every collective is a no-op copy-free pass-through on a world of one.

Ownership rule: a collective that works in place only ever touches a buffer this module
allocated. Autograd can hand the same gradient tensor to several consumers, and a
non-contiguous input's ``.contiguous()`` is a copy whose reduction would otherwise be lost, so
the public ops never reduce a caller's tensor in place.

Hidden-dim ops split / gather the last dim. Sequence ops use ``seq_dim``, by default -2: the
dim before hidden, i.e. ``seq`` of batch-first ``[batch, seq, hidden]`` activations (and the
token dim of ``[tokens, hidden]``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .collectives import all_gather, all_reduce, owned_copy, reduce_scatter, split
from .groups import GroupLike, TPGroup, replica_slot, resolve_group
from .blocking import sum_over_replica_ranks
from .seq_order import gather_rank_major_from_sequence
from .siblings import ColumnInputs

__all__ = [
    "copy_to_tp",
    "copy_many_to_tp",
    "copy_many_to_replicas",
    "reduce_from_tp",
    "scatter_to_tp",
    "gather_from_tp",
    "scatter_to_sequence",
    "gather_from_sequence",
    "gather_sequence_for_columns",
    "reduce_scatter_to_sequence",
    "sum_over_replicas",
]

# ---------------------------------------------------------------- autograd Functions
#
# Conjugate pairs (f and g, split and gather, ...): each backward is its partner's ``apply``, itself
# differentiable, so second derivatives (``create_graph=True``, e.g. a gradient penalty) are right.
# Under plain backward, grad mode is off and ``apply`` records nothing: the same one collective.


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ReduceFromTP.apply(grad, ctx.g), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        ctx.g = g
        return all_reduce(owned_copy(x), g).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _CopyToTP.apply(grad, ctx.g), None


class _CopyManyToReplicas(torch.autograd.Function):
    """Several tensors replicated alike over runs of ranks (a KV head's k and v weights and biases):
    identity forward; backward their gradients summed over the ranks holding the same replica by ONE
    collective (see :func:`copy_many_to_replicas`). First derivatives only."""

    @staticmethod
    def forward(ctx, g: TPGroup, holders: Tuple[int, ...], *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.g, ctx.holders = g, holders
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, *_sum_packed(grads, ctx.g, ctx.holders))


class _CopyManyToTP(torch.autograd.Function):
    """f for several tensors entering one region (an MoE layer's tokens and routing weights):
    identity forward; backward one all-reduce of all their gradients (see :func:`copy_many_to_tp`).
    First derivatives only."""

    @staticmethod
    def forward(ctx, g: TPGroup, *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.g = g  # (an output no one used gets a zero gradient: every rank's buffer has the same layout)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, *_sum_packed(grads, ctx.g))


def _packs_into(dtype: torch.dtype, into: torch.dtype) -> bool:
    """Whether every ``dtype`` value is exact in ``into`` (float32 into float64, bfloat16 into float32)."""
    if dtype == into:
        return True
    return (dtype.is_floating_point and into.is_floating_point and torch.promote_types(dtype, into) == into
            and torch.finfo(dtype).bits < torch.finfo(into).bits and {dtype, into} != {torch.float16, torch.bfloat16})


def _sum_packed(grads: Sequence[torch.Tensor], g: TPGroup,
                holders: Optional[Tuple[int, ...]] = None) -> List[torch.Tensor]:
    """Each gradient summed over the group (``holders``: over the ranks holding the same replica, see
    `sum_over_replica_ranks`): those whose dtype converts exactly into the largest one's share one
    collective of one buffer (in that dtype); any other (float32 routing weights beside bfloat16
    tokens) gets its own. Never in place (autograd's tensors are not ours). Autograd materializes a
    missing gradient as zeros, so every rank packs the same layout."""
    anchor = max(grads, key=lambda t: t.numel()).dtype
    packed = [i for i, t in enumerate(grads) if _packs_into(t.dtype, anchor)]
    buf = torch.empty(sum(grads[i].numel() for i in packed), dtype=anchor, device=grads[packed[0]].device)
    offset, where = 0, {}
    for i in packed:
        buf[offset:offset + grads[i].numel()].view(grads[i].shape).copy_(grads[i])
        where[i] = offset
        offset += grads[i].numel()
    if holders is not None:
        buf = sum_over_replica_ranks(buf, g, holders)
        alone = {i: sum_over_replica_ranks(t, g, holders) for i, t in enumerate(grads) if i not in where}
    else:
        pending = all_reduce(buf, g)
        launched = {i: all_reduce(owned_copy(t), g) for i, t in enumerate(grads) if i not in where}
        pending.wait()
        alone = {i: p.wait() for i, p in launched.items()}
    return [buf[where[i]:where[i] + t.numel()].view(t.shape).to(t.dtype) if i in where else alone[i]
            for i, t in enumerate(grads)]


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's chunk of the last dim; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        ctx.g = g
        return split(x, -1, g)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherFromTP.apply(grad, ctx.g), None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dim; backward keeps this rank's chunk of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        ctx.g = g
        return all_gather(x, -1, g).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ScatterToTP.apply(grad, ctx.g), None


class _ScatterToSequence(torch.autograd.Function):
    """Enter a sequence-parallel region: keep this rank's sequence chunk; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup, dim: int) -> torch.Tensor:
        ctx.g, ctx.dim = g, dim
        return split(x, dim, g)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherFromSequence.apply(grad, ctx.g, ctx.dim, False), None, None


class _GatherFromSequence(torch.autograd.Function):
    """All-gather the sequence dim. Backward: reduce-scatter when the consumer of the gathered
    tensor is tensor-parallel (each rank holds a partial gradient), else a plain split."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup, dim: int, grad_is_partial: bool) -> torch.Tensor:
        ctx.g, ctx.dim, ctx.partial = g, dim, grad_is_partial
        return all_gather(x, dim, g).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.partial:
            return _ReduceScatterToSequence.apply(grad, ctx.g, ctx.dim), None, None, None
        return _ScatterToSequence.apply(grad, ctx.g, ctx.dim), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Leave a TP region into a sequence-parallel one: reduce-scatter; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup, dim: int) -> torch.Tensor:
        ctx.g, ctx.dim = g, dim
        return reduce_scatter(x, dim, g).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherFromSequence.apply(grad, ctx.g, ctx.dim, True), None, None


class _SumOverReplicas(torch.autograd.Function):
    """Identity forward; backward sums the gradient of rows ``[start, stop)`` (dim 0) over the
    ranks holding the same replica of them, and passes the other rows through.

    Ranks are grouped in runs of ``holders[j]`` consecutive ranks (the layout of KV heads replicated
    over more ranks than there are heads). One all-reduce of a ``(len(holders), stop - start, ...)``
    buffer with this rank's rows in its run's slot.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup, holders: Tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        ctx.g, ctx.holders, ctx.rows = g, holders, (start, stop)
        # No gradient (a delayed weight gradient: delay_wgrad) stays None: no all-reduce of zeros now;
        # the gradient comes through here later, when the recorded work is flushed.
        ctx.set_materialize_grads(False)
        return x.view_as(x)  # a view: no copy of x is made or saved

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor]):
        if grad is None:
            return None, None, None, None, None
        return _ReduceOverReplicas.apply(grad, ctx.g, ctx.holders, *ctx.rows), None, None, None, None


class _ReduceOverReplicas(torch.autograd.Function):
    """The conjugate of `_SumOverReplicas`: rows ``[start, stop)`` summed over the ranks holding
    the same replica of them forward (the other rows pass through); identity backward."""

    @staticmethod
    def forward(ctx, grad: torch.Tensor, g: TPGroup, holders: Tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        ctx.g, ctx.holders, ctx.rows = g, holders, (start, stop)
        summed = sum_over_replica_ranks(grad[start:stop], g, holders)
        if start == 0 and stop == grad.shape[0]:
            return summed
        out = grad.clone(memory_format=torch.contiguous_format)  # never write into autograd's grad
        out[start:stop] = summed
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _SumOverReplicas.apply(grad, ctx.g, ctx.holders, *ctx.rows), None, None, None, None


# ---------------------------------------------------------------- public wrappers


def copy_to_tp(x: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (enter a TP region)."""
    g = resolve_group(group)
    return x if g.size == 1 else _CopyToTP.apply(x, g)


def copy_many_to_tp(xs: Sequence[torch.Tensor], *, group: GroupLike) -> Tuple[torch.Tensor, ...]:
    """f for several tensors at once: identity forward; backward their gradients summed over the
    group by ONE all-reduce (a tensor whose dtype does not convert exactly into the largest tensor's,
    e.g. float32 beside bfloat16, gets a second). Floating-point tensors only."""
    g = resolve_group(group)
    if g.size == 1 or not xs:
        return tuple(xs)
    bad = [i for i, x in enumerate(xs) if not (torch.is_tensor(x) and x.is_floating_point())]
    if bad:
        raise TypeError(f"copy_many_to_tp: input {bad[0]} is not a floating-point tensor")
    return _CopyManyToTP.apply(g, *xs)


def copy_many_to_replicas(xs: Sequence[torch.Tensor], *, group: GroupLike,
                          holders: Sequence[int]) -> Tuple[torch.Tensor, ...]:
    """Identity forward; backward the gradients of ``xs`` (every one replicated alike: the group's ranks
    in runs of ``holders[j]`` consecutive ranks holding the same values) summed over their replica
    ranks by ONE collective over the run's own group (`tplayers.core.collectives.replica_group`), as
    :func:`sum_over_replicas` does for one tensor's rows. Floating-point tensors only."""
    g = resolve_group(group)
    holders = tuple(int(n) for n in holders)
    replica_slot(holders, g, "copy_many_to_replicas")  # raises naming a layout that does not cover the group
    if max(holders) == 1 or not xs:
        return tuple(xs)
    bad = [i for i, x in enumerate(xs) if not (torch.is_tensor(x) and x.is_floating_point())]
    if bad:
        raise TypeError(f"copy_many_to_replicas: input {bad[0]} is not a floating-point tensor")
    return _CopyManyToReplicas.apply(g, holders, *xs)


def reduce_from_tp(x: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (leave a TP region)."""
    g = resolve_group(group)
    return x if g.size == 1 else _ReduceFromTP.apply(x, g)


def scatter_to_tp(x: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """This rank's chunk of the last dim; the gradient is all-gathered backward."""
    g = resolve_group(group)
    return x if g.size == 1 else _ScatterToTP.apply(x, g)


def gather_from_tp(x: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """All-gather the last dim; the gradient is split backward."""
    g = resolve_group(group)
    return x if g.size == 1 else _GatherFromTP.apply(x, g)


def scatter_to_sequence(x: torch.Tensor, *, group: GroupLike, seq_dim: int = -2) -> torch.Tensor:
    """This rank's chunk of the sequence dim; the gradient is all-gathered backward."""
    g = resolve_group(group)
    return x if g.size == 1 else _ScatterToSequence.apply(x, g, seq_dim)


def gather_from_sequence(
    x: torch.Tensor, *, group: GroupLike, seq_dim: int = -2, grad_is_partial: bool = True
) -> torch.Tensor:
    """All-gather the sequence dim. Backward reduce-scatters (``grad_is_partial=True``, the
    gathered tensor feeds a TP region) or splits (it feeds replicated computation)."""
    g = resolve_group(group)
    return x if g.size == 1 else _GatherFromSequence.apply(x, g, seq_dim, grad_is_partial)


def gather_sequence_for_columns(x: torch.Tensor, *, group: GroupLike, inputs: ColumnInputs,
                                rank_major: bool = False) -> torch.Tensor:
    """All-gather the sequence dim (-2) of ``x`` for a module whose code needs the whole sequence and whose
    column-parallel layers read it (HF attention; the LM head after the last norm). ``rank_major``: in the
    collective's own token order (no copy; ``seq_order.in_sequence_shape``), for a module whose code reads only the
    gathered tensor's shape: the column layers put their outputs in the sequence's order (their ``out/p`` features).

    Backward splits the gradient that reaches the gathered tensor (complete: whatever replicated code
    read it). The column layers whose declared sets hold ``inputs`` (`tplayers.core.siblings`), called on
    the gathered tensor itself, take the sequence-parallel path on ``x`` instead: they keep only ``x`` for
    backward, gather it again there and reduce-scatter their input gradient into ``x`` (Megatron's layout,
    not an all-reduce of the whole sequence)."""
    g = resolve_group(group)
    if g.size == 1:
        return x
    if rank_major:
        x_full = gather_rank_major_from_sequence(x, group=g, grad_is_partial=False)
    else:
        x_full = _GatherFromSequence.apply(x, g, -2, False)
    if x.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling():  # (compiled: no sets)
        inputs.offer(x_full, x, g, rank_major)
    return x_full


def reduce_scatter_to_sequence(x: torch.Tensor, *, group: GroupLike, seq_dim: int = -2) -> torch.Tensor:
    """Sum over the group and keep this rank's sequence chunk; all-gather backward."""
    g = resolve_group(group)
    return x if g.size == 1 else _ReduceScatterToSequence.apply(x, g, seq_dim)


def sum_over_replicas(x: torch.Tensor, *, group: GroupLike, holders: Sequence[int],
                      rows: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """Identity forward (a view, no copy). Backward: the gradient of ``x`` (or of its dim-0 rows
    ``rows=(start, stop)``) summed over the consecutive ranks that hold the same replica of it (e.g. a
    KV head shared by several ranks): the group's ranks in runs of ``holders[j]`` (``(2, 2)``: two
    replicas on two ranks each; ``(2, 1)`` at TP 3)."""
    g = resolve_group(group)
    holders = tuple(int(n) for n in holders)
    replica_slot(holders, g, "sum_over_replicas")  # raises naming a layout that does not cover the group
    start, stop = (0, x.shape[0]) if rows is None else rows
    if not 0 <= start <= stop <= x.shape[0]:
        raise ValueError(f"sum_over_replicas: rows={rows} outside dim 0 of size {x.shape[0]}")
    if max(holders) == 1 or start == stop:
        return x
    return _SumOverReplicas.apply(x, g, holders, start, stop)
