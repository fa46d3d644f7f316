"""A tensor that every rank holds a partial sum of, summed only when its values are read.

A vocabulary-parallel embedding's lookup is partial on each rank (rows of other ranks' words are
zero). Megatron's sequence-parallel layout reduce-scatters it straight into the split residual stream;
a Hugging Face model cannot take that: between its embedding and its first decoder layer it reads the
embedding's output for its (b, s) shape, dtype and device (positions, the causal mask), and some
families compute with it (Gemma scales it, GPT-2 adds position embeddings). So the embedding returns a
:class:`PartialSum`::

    Before                                        Now
    embedding: all_reduce(partial)  (b, s, h)     embedding: PartialSum(partial)  (b, s, h), no collective
    (shape, dtype, device read)                   (shape, dtype, device read: metadata, no collective)
    first layer: split -> (b, s/p, h)             first layer: reduce_scatter(partial) -> (b, s/p, h)

With a batch, the lookup reduce-scattered unread last time is made in the collective's rank-major token order
(``core/seq_order.py``: the ids reordered, b*s integers), so that neither the reduce-scatter's input nor its
gradient's all-gather is reordered (two copies of the whole activation per step); a read of its values puts it
back in the sequence's order first (one copy), and the next lookup is made in the sequence's order
(:class:`ScatterOrder`: the module's memory of which use came last).

Two uses keep it unsummed, both exact: adding a tensor of its shape and dtype (GPT-2 and OPT add their
position embeddings: the sum's chunk is this rank's reduce-scattered chunk plus the addend's chunk, one
all-gather of the gradient backward serving both), and a dropout that drops nothing (``p == 0``, or not
training). Every other use of its values (any torch function or method on it: a product, a norm,
``repr``, a custom Function) sums it first, with one all-reduce kept for later reads: whatever reads it
sees the complete values, so the deferral can change the collectives but never a number.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Optional

import torch

from ..core.collectives import all_gather, from_rank_major, gather_rank_major, reduce_scatter, split
from ..core.comm import reduce_from_tp, reduce_scatter_to_sequence, scatter_to_sequence
from ..core.fingerprint import SETTINGS, checks_enabled
from ..core.sites import in_a_forward, reading
from ..core.store_barrier import store_barrier
from ..core.groups import TPGroup
from ..core.seq_order import in_sequence_shape, rank_major_view, reduce_scatter_rank_major

__all__ = ["METADATA", "PartialSum", "ScatterOrder", "partial_sum"]

OUTSIDE_ADVICE = ("Summing a PartialSum is collective: read it on every rank of the TP group (compute the norm you "
                  "log on every rank, print it on rank 0), or log what the model's forward returns")

METADATA = frozenset({  # what reads a tensor's metadata, not its values
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.layout.__get__, torch.Tensor.requires_grad.__get__,
    torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__, torch.Tensor.is_cuda.__get__,
    torch.Tensor.is_meta.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.get_device,
    torch.Tensor.__len__,
})


_ADD = frozenset({torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__})


class ScatterOrder:
    """Which use took a module's last :class:`PartialSum`: ``rank_major`` when it was reduce-scattered unread (the
    next one is made in the collective's rank-major order), False when its values were read (the sequence's order).
    A performance choice only: either order gives the same values."""

    __slots__ = ("rank_major",)

    def __init__(self) -> None:
        self.rank_major = False


class PartialSum(torch.Tensor):
    """Each rank's partial sum plus an optional addend of its own (see the module docstring): its metadata
    reads as the value's; any other use of its values uses :meth:`summed`. Made by :func:`partial_sum`."""

    _partial: torch.Tensor
    _addend: Optional[torch.Tensor]
    _group: TPGroup
    _summed: Optional[torch.Tensor]
    _source: Any  # the module that made it (named in the description of the collective that sums it)
    _rank_major: bool  # the partial's tokens are in rank-major order (seq_order.in_sequence_shape), batch-first
    _order: Optional[ScatterOrder]  # told which use took it

    def summed(self, why: str = "a read of its values") -> torch.Tensor:
        """The value: the partials summed over the group (an all-reduce the first time; the result is
        kept), plus the addend. ``why``: what reads it, for the collective's description."""
        if self._summed is None:
            source = ("an embedding" if self._source is None else
                      self._source.__dict__.get("_tplayers_path") or type(self._source).__name__)
            if checks_enabled() and not in_a_forward(sys._getframe(1)):  # a read in user code: a rank may be alone
                store_barrier(self._group, f"read the output of {source} (a PartialSum: each rank holds a share of "
                              f"the sum) outside the model's forward, for {why}", SETTINGS.timeout, OUTSIDE_ADVICE)
            self._tell(False)
            with reading(f"the output of {source} (a PartialSum: each rank holds a share of the sum), summed for "
                         f"{why}; every rank of the TP group must read it (a read on one rank only, such as "
                         "logging on rank 0, waits for the others)"):
                total = reduce_from_tp(self._in_sequence_order(), group=self._group)
            self._summed = total if self._addend is None else total + self._addend
        return self._summed

    def reduce_scatter(self, seq_dim: int = -2) -> torch.Tensor:
        """This rank's sequence chunk of the value: a reduce-scatter (plus the addend's chunk), or a split
        of a value already summed."""
        if self._summed is not None:
            return scatter_to_sequence(self._summed, group=self._group, seq_dim=seq_dim)
        if self._addend is not None and self._addend.shape[seq_dim] != self._partial.shape[seq_dim]:
            return scatter_to_sequence(self.summed(), group=self._group, seq_dim=seq_dim)  # (broadcast along it)
        self._tell(True)
        rank_major = self._rank_major and seq_dim % self._partial.dim() == self._partial.dim() - 2
        partial = self._partial if rank_major else self._in_sequence_order()
        if self._addend is not None:
            return _ReduceScatterAdd.apply(partial, self._addend, self._group, seq_dim, rank_major)
        if rank_major:
            return reduce_scatter_rank_major(partial, group=self._group)
        return reduce_scatter_to_sequence(partial, group=self._group, seq_dim=seq_dim)

    def _in_sequence_order(self) -> torch.Tensor:
        """The partial with its tokens in the sequence's order (a copy when it was made rank-major)."""
        if not self._rank_major:
            return self._partial
        return from_rank_major(rank_major_view(self._partial, self._group.size))

    def _tell(self, reduce_scattered: bool) -> None:
        if self._order is not None:
            self._order.rank_major = reduce_scattered

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[Dict[str, Any]] = None):
        kwargs = kwargs or {}
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _ADD and not kwargs and len(args) == 2:
            kept = _plus(*args) if isinstance(args[0], PartialSum) else _plus(args[1], args[0])
            if kept is not None:
                return kept
        if func is torch.nn.functional.dropout and _drops_nothing(*args, **kwargs):
            return args[0] if args else kwargs["input"]
        why = getattr(func, "__name__", str(func))
        args, kwargs = torch.utils._pytree.tree_map(lambda a: a.summed(why) if isinstance(a, PartialSum) else a,
                                                    (args, kwargs))
        return func(*args, **kwargs)


def _plus(x: PartialSum, other: Any) -> Optional[PartialSum]:
    """``x + other`` kept unsummed: ``other`` a plain tensor of ``x``'s dtype and dims that broadcasts to
    ``x``'s shape (GPT-2's positions: (1, s, h)), no promotion, and ``x`` not summed yet; else None."""
    if (x._summed is not None or not torch.is_tensor(other) or isinstance(other, PartialSum)
            or other.dtype != x.dtype or other.device != x.device or other.dim() != x.dim()
            or torch.broadcast_shapes(other.shape, x.shape) != x.shape):
        return None
    with torch._C.DisableTorchFunctionSubclass():
        addend = other if x._addend is None else x._addend + other
    return _wrap(x._partial, addend, x._group, x._source, x._rank_major, x._order)


def _drops_nothing(input: Any = None, p: float = 0.5, training: bool = True, inplace: bool = False) -> bool:
    return not inplace and (p == 0 or not training)


class _ReduceScatterAdd(torch.autograd.Function):
    """This rank's sequence chunk of ``sum(partial) + addend``; backward one all-gather of the chunk's
    gradient, the gradient of both. ``rank_major``: the partial's tokens are in rank-major order (dim -2), the
    addend's in the sequence's."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, addend: torch.Tensor, g: TPGroup, dim: int,
                rank_major: bool) -> torch.Tensor:
        ctx.g, ctx.dim, ctx.addend_shape, ctx.rank_major = g, dim, addend.shape, rank_major
        if rank_major:  # (p, ..., s/p, h) as (p * ..., s/p, h): rank r's block of dim 0 is its chunk
            partial, dim = rank_major_view(partial, g.size).flatten(0, 1), 0
        return reduce_scatter(partial, dim, g).wait().add_(split(addend, ctx.dim, g))  # (the collective's buffer)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.rank_major:
            full = all_gather(grad, ctx.dim, ctx.g).wait()
            return full, full.sum_to_size(ctx.addend_shape), None, None, None  # (a broadcast addend: summed)
        full = gather_rank_major(grad, ctx.g).wait()  # (p, ..., s/p, h)
        shape = ctx.addend_shape
        summed = full.sum_to_size((ctx.g.size,) + tuple(shape[:-2]) + tuple(full.shape[-2:]))  # over what broadcast
        return in_sequence_shape(full), from_rank_major(summed), None, None, None


def _wrap(partial: torch.Tensor, addend: Optional[torch.Tensor], group: TPGroup, source: Any, rank_major: bool,
          order: Optional[ScatterOrder]) -> PartialSum:
    out = partial.as_subclass(PartialSum)
    out._partial, out._addend, out._group, out._summed, out._source = partial, addend, group, None, source
    out._rank_major, out._order = rank_major, order
    return out


def partial_sum(partial: torch.Tensor, *, group: TPGroup, source: Any = None, rank_major: bool = False,
                order: Optional[ScatterOrder] = None) -> torch.Tensor:
    """``partial`` (this rank's share of a sum over ``group``) as a :class:`PartialSum`; summed at once
    where deferring is not possible (a world of one: ``partial`` itself; under torch.compile). ``source``:
    the module that made it, named if a read of it goes wrong. ``rank_major``: ``partial`` ``(..., s, h)`` holds its
    tokens in rank-major order (a lookup of reordered ids); ``order``: told which use takes it."""
    if rank_major and (group.size == 1 or torch.compiler.is_compiling()):
        raise ValueError("partial_sum: a rank-major partial is only deferred (TP > 1, eager): make it in the "
                         "sequence's order")
    if group.size == 1:
        return partial
    if torch.compiler.is_compiling():
        return reduce_from_tp(partial, group=group)
    return _wrap(partial, None, group, source, rank_major, order)
