"""Differentiable collectives over a TP group: the paper's f and g, and their sequence twins.

Three tiers, as in Megatron-core: private collectives (``_all_reduce`` ...) that return a
`Pending` handle so callers can overlap them with compute; private autograd Functions; public
snake_case wrappers. Every collective is a no-op copy-free pass-through on a world of one.

Ownership rule: a collective that works in place only ever touches a buffer this module
allocated. Autograd can hand the same gradient tensor to several consumers, and a
non-contiguous input's ``.contiguous()`` is a copy whose reduction would otherwise be lost, so
the public ops never reduce a caller's tensor in place.

Hidden-dim ops split / gather the last dim. Sequence ops use ``seq_dim``, by default -2: the
dim before hidden, i.e. ``seq`` of batch-first ``[batch, seq, hidden]`` activations (and the
token dim of ``[tokens, hidden]``).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .groups import GroupLike, TPGroup, collective_device, resolve_group
from .placement import Placement

__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "gather_from_tp",
    "scatter_to_sequence",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "sum_over_replicas",
    "all_gather_tensor",
    "all_reduce_tensor",
    "broadcast_tensor",
    "barrier",
    "reduce_scatter_tensor",
    "all_reduce_",
    "gather_placed",
    "Pending",
]

# torch 2.13 renamed the single-tensor collectives; 2.4-2.12 only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """A collective in flight. ``wait()`` blocks until it is done and returns its result."""

    __slots__ = ("_work", "_finish", "_result")

    def __init__(self, work: Optional[object], finish: Callable[[], torch.Tensor]) -> None:
        self._work = work
        self._finish = finish
        self._result: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
        return self._result


def _done(t: torch.Tensor) -> Pending:
    return Pending(None, lambda: t)


# ---------------------------------------------------------------- private collectives


def _check_divisible(size: int, g: TPGroup, what: str) -> None:
    if size % g.size != 0:
        raise ValueError(f"{what} of size {size} is not divisible by the TP degree {g.size}")


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _all_reduce(buf: torch.Tensor, g: TPGroup, *, async_op: bool = False, op: str = "sum") -> Pending:
    """Sum (or ``op="max"``) ``buf`` over the group, in place. ``buf`` must be a contiguous
    tensor the caller owns."""
    if g.size == 1:
        return _done(buf)
    assert buf.is_contiguous(), "all-reduce needs an owned contiguous buffer"
    work = dist.all_reduce(buf, op=_REDUCE_OPS[op], group=g.process_group, async_op=async_op)
    return Pending(work, lambda: buf)


def _all_gather(x: torch.Tensor, dim: int, g: TPGroup, *, async_op: bool = False) -> Pending:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    if g.size == 1:
        return _done(x)
    dim = dim % x.dim()
    src = x.contiguous()
    out = torch.empty((g.size * src.shape[0],) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    work = _all_gather_single(out, src, group=g.process_group, async_op=async_op)
    if dim == 0:
        return Pending(work, lambda: out)

    def finish() -> torch.Tensor:
        # (p*d0, ...) -> (p, d0, ..., d_dim, ...) -> (d0, ..., p, d_dim, ...) -> merge p into dim
        parts = out.view((g.size,) + tuple(src.shape)).movedim(0, dim)
        shape = list(src.shape)
        shape[dim] *= g.size
        return parts.reshape(shape)

    return Pending(work, finish)


def _reduce_scatter(x: torch.Tensor, dim: int, g: TPGroup, *, async_op: bool = False) -> Pending:
    """Sum over the group, then keep this rank's chunk along ``dim``. Never modifies ``x``."""
    if g.size == 1:
        return _done(x)
    dim = dim % x.dim()
    _check_divisible(x.shape[dim], g, f"dim {dim} of a reduce-scatter input")
    if dim == 0:
        src = x.contiguous()
    else:  # bring the p chunks of `dim` to the front so each rank's chunk is contiguous
        shape = list(x.shape)
        shape[dim : dim + 1] = [g.size, shape[dim] // g.size]
        src = x.reshape(shape).movedim(dim, 0).contiguous()
    out_shape = list(x.shape)
    out_shape[dim] //= g.size
    if dim == 0:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
        work = _reduce_scatter_single(out, src, group=g.process_group, async_op=async_op)
        return Pending(work, lambda: out)
    chunk_shape = list(src.shape[1:])
    src = src.reshape([g.size * chunk_shape[0]] + chunk_shape[1:])  # the collective splits dim 0
    out = torch.empty(chunk_shape, dtype=x.dtype, device=x.device)
    work = _reduce_scatter_single(out, src, group=g.process_group, async_op=async_op)
    return Pending(work, lambda: out.reshape(out_shape))


def _split(x: torch.Tensor, dim: int, g: TPGroup) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (torch.chunk order), as an owned contiguous tensor."""
    if g.size == 1:
        return x
    _check_divisible(x.shape[dim], g, f"dim {dim} of a tensor split across the TP group")
    return x.chunk(g.size, dim=dim)[g.rank].contiguous()


def _owned_copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------- autograd Functions


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(_owned_copy(grad), ctx.g).wait(), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        return _all_reduce(_owned_copy(x), g).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's chunk of the last dim; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        ctx.g = g
        return _split(x, -1, g)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, -1, ctx.g).wait(), None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dim; backward keeps this rank's chunk of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        ctx.g = g
        return _all_gather(x, -1, g).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split(grad, -1, ctx.g), None


class _ScatterToSequence(torch.autograd.Function):
    """Enter a sequence-parallel region: keep this rank's sequence chunk; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup, dim: int) -> torch.Tensor:
        ctx.g, ctx.dim = g, dim
        return _split(x, dim, g)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.g).wait(), None, None


class _GatherFromSequence(torch.autograd.Function):
    """All-gather the sequence dim. Backward: reduce-scatter when the consumer of the gathered
    tensor is tensor-parallel (each rank holds a partial gradient), else a plain split."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup, dim: int, grad_is_partial: bool) -> torch.Tensor:
        ctx.g, ctx.dim, ctx.partial = g, dim, grad_is_partial
        return _all_gather(x, dim, g).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.partial:
            return _reduce_scatter(grad, ctx.dim, ctx.g).wait(), None, None, None
        return _split(grad, ctx.dim, ctx.g), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Leave a TP region into a sequence-parallel one: reduce-scatter; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup, dim: int) -> torch.Tensor:
        ctx.g, ctx.dim = g, dim
        return _reduce_scatter(x, dim, g).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.g).wait(), None, None


class _SumOverReplicas(torch.autograd.Function):
    """Identity forward; backward sums the gradient of rows ``[start, stop)`` (dim 0) over the
    ranks holding the same replica of them, and passes the other rows through.

    Ranks are grouped in ``num_shards`` consecutive runs of ``p // num_shards`` (the layout of
    KV heads replicated over more ranks than there are heads). One all-reduce of a
    ``(num_shards, stop - start, ...)`` buffer with this rank's rows in its run's slot.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup, num_shards: int, start: int, stop: int) -> torch.Tensor:
        ctx.g, ctx.num_shards, ctx.rows = g, num_shards, (start, stop)
        return x.view_as(x)  # a view: no copy of x is made or saved

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, n, (start, stop) = ctx.g, ctx.num_shards, ctx.rows
        slot = g.rank // (g.size // n)
        buf = grad.new_zeros((n, stop - start) + tuple(grad.shape[1:]))
        buf[slot].copy_(grad[start:stop])
        summed = _all_reduce(buf, g).wait()[slot]
        if start == 0 and stop == grad.shape[0]:
            return summed, None, None, None, None
        out = grad.clone(memory_format=torch.contiguous_format)  # never write into autograd's grad
        out[start:stop] = summed
        return out, None, None, None, None


# ---------------------------------------------------------------- public wrappers


def copy_to_tp(x: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (enter a TP region)."""
    g = resolve_group(group)
    return x if g.size == 1 else _CopyToTP.apply(x, g)


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


def reduce_scatter_to_sequence(x: torch.Tensor, *, group: GroupLike, seq_dim: int = -2) -> torch.Tensor:
    """Sum over the group and keep this rank's sequence chunk; all-gather backward."""
    g = resolve_group(group)
    return x if g.size == 1 else _ReduceScatterToSequence.apply(x, g, seq_dim)


def sum_over_replicas(x: torch.Tensor, *, group: GroupLike, num_shards: int,
                      rows: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """Identity forward (a view, no copy). Backward: the gradient of ``x`` (or of its dim-0 rows
    ``rows=(start, stop)``) summed over the ``p // num_shards`` consecutive ranks that hold the
    same replica of it (e.g. a KV head shared by several ranks)."""
    g = resolve_group(group)
    if num_shards < 1 or g.size % num_shards:
        raise ValueError(f"sum_over_replicas: num_shards={num_shards} does not divide the TP degree {g.size}")
    start, stop = (0, x.shape[0]) if rows is None else rows
    if not 0 <= start <= stop <= x.shape[0]:
        raise ValueError(f"sum_over_replicas: rows={rows} outside dim 0 of size {x.shape[0]}")
    if num_shards == g.size or start == stop:
        return x
    return _SumOverReplicas.apply(x, g, num_shards, start, stop)


# ---------------------------------------------------------------- non-differentiable helpers


def all_gather_tensor(x: torch.Tensor, dim: int, *, group: GroupLike) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (no autograd). Used to rebuild dense weights."""
    with torch.no_grad():
        return _all_gather(x.detach(), dim, resolve_group(group)).wait()


def all_reduce_tensor(x: torch.Tensor, *, group: GroupLike, op: str = "sum") -> torch.Tensor:
    """Sum (``op="sum"``) or maximum (``op="max"``) of ``x`` over the group as a new tensor
    (no autograd); ``x`` is left untouched."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce_tensor: op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    with torch.no_grad():
        g = resolve_group(group)
        return x.detach() if g.size == 1 else _all_reduce(_owned_copy(x.detach()), g, op=op).wait()


def barrier(group: GroupLike) -> None:
    """Every rank of the group reaches this point before any leaves (a 1-element all-reduce, so it
    runs on any backend and honours the group's timeout)."""
    g = resolve_group(group)
    if g.size > 1:
        all_reduce_tensor(torch.zeros(1, device=collective_device(g.process_group)), group=g)


def reduce_scatter_tensor(x: torch.Tensor, dim: int, *, group: GroupLike) -> torch.Tensor:
    """This rank's chunk (along ``dim``) of the sum of every rank's ``x``, as a new tensor (no autograd)."""
    with torch.no_grad():
        g = resolve_group(group)
        return x.detach() if g.size == 1 else _reduce_scatter(x.detach(), dim, g).wait()


def all_reduce_(x: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """Sum ``x`` over the group IN PLACE and return it (no autograd, no copy). Only for a buffer the
    caller owns outright (benchmarks timing the bare collective); everything else uses the copying ops."""
    g = resolve_group(group)
    if g.size == 1:
        return x
    if not x.is_contiguous():
        raise ValueError("all_reduce_: the buffer must be contiguous (a reduction into a copy would be lost)")
    with torch.no_grad():
        return _all_reduce(x, g).wait()


def broadcast_tensor(x: torch.Tensor, src_rank: int, *, group: GroupLike) -> torch.Tensor:
    """``x`` of group rank ``src_rank``, on every rank, as a new tensor (no autograd)."""
    with torch.no_grad():
        g = resolve_group(group)
        if g.size == 1:
            return x.detach()
        buf = _owned_copy(x.detach())
        src = dist.get_global_rank(g.process_group, src_rank) if g.process_group is not None else src_rank
        dist.broadcast(buf, src=src, group=g.process_group)
        return buf


def gather_placed(local: torch.Tensor, placement: Placement, *, group: GroupLike) -> torch.Tensor:
    """The dense tensor of ``placement`` rebuilt on every rank from each rank's ``local`` (no
    autograd). A replicated placement returns ``local`` itself: no communication."""
    if not placement.is_sharded:
        return local.detach()
    g = resolve_group(group)
    gathered = all_gather_tensor(local.contiguous(), placement.dim, group=g)
    return placement.unshard(gathered.chunk(g.size, dim=placement.dim))
