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

Every other use of its values (any torch function or method on it: a product, a sum, ``repr``, a
custom Function) sums it first, with one all-reduce kept for later reads: whatever reads it sees the
complete values, so the deferral can change the collectives but never a number.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .comm import reduce_from_tp, reduce_scatter_to_sequence, scatter_to_sequence
from .groups import TPGroup

__all__ = ["PartialSum", "partial_sum"]

_METADATA = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.layout.__get__, torch.Tensor.requires_grad.__get__,
    torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__, torch.Tensor.is_cuda.__get__,
    torch.Tensor.is_meta.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.get_device,
    torch.Tensor.__len__,
})


class PartialSum(torch.Tensor):
    """Each rank's partial sum (see the module docstring): its metadata reads as the sum's; any use of its
    values uses :meth:`summed`. Made by :func:`partial_sum`."""

    _partial: torch.Tensor
    _group: TPGroup
    _summed: Optional[torch.Tensor]

    def summed(self) -> torch.Tensor:
        """The sum over the group (an all-reduce the first time; the result is kept)."""
        if self._summed is None:
            self._summed = reduce_from_tp(self._partial, group=self._group)
        return self._summed

    def reduce_scatter(self, seq_dim: int = -2) -> torch.Tensor:
        """This rank's sequence chunk of the sum: a reduce-scatter, or a split of a sum already made."""
        if self._summed is not None:
            return scatter_to_sequence(self._summed, group=self._group, seq_dim=seq_dim)
        return reduce_scatter_to_sequence(self._partial, group=self._group, seq_dim=seq_dim)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[Dict[str, Any]] = None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = torch.utils._pytree.tree_map(lambda a: a.summed() if isinstance(a, PartialSum) else a,
                                                    (args, kwargs))
        return func(*args, **kwargs)


def partial_sum(partial: torch.Tensor, *, group: TPGroup) -> torch.Tensor:
    """``partial`` (this rank's share of a sum over ``group``) as a :class:`PartialSum`; summed at once
    where deferring is not possible (a world of one: ``partial`` itself; under torch.compile)."""
    if group.size == 1:
        return partial
    if torch.compiler.is_compiling():
        return reduce_from_tp(partial, group=group)
    out = partial.as_subclass(PartialSum)
    out._partial, out._group, out._summed = partial, group, None
    return out
