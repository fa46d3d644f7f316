"""The 0.1 names of what placements replaced, kept importing (deprecated): ``ShardLayout`` (from
``tplayers.layers``), ``PaddedShardLayout``, ``padded_vocab_size``, ``vocab_range`` (from
``tplayers.embedding``). Each returns or computes the equivalent placement; new code uses
:mod:`tplayers.core.placement` directly."""
from __future__ import annotations

import warnings
from typing import Optional, Sequence, Tuple

from ..core.placement import Part, Placement, Replicated, Sharded, padded_size

__all__ = ["ShardLayout", "PaddedShardLayout", "padded_vocab_size", "vocab_range"]


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: use {new} (tplayers.core.placement)", DeprecationWarning, stacklevel=3)


class ShardLayout:
    """``ShardLayout(dim, parts)`` -> ``Sharded`` (``dim=None``: ``Replicated``)."""

    def __new__(cls, dim: Optional[int], parts: Sequence[Tuple[int, int]] = ()) -> Placement:  # type: ignore[misc]
        _deprecated("ShardLayout", "Sharded / Replicated")
        return Replicated() if dim is None else Sharded(dim, tuple(Part(size, n) for size, n in parts))

    @staticmethod
    def replicated() -> Placement:
        _deprecated("ShardLayout.replicated()", "Replicated()")
        return Replicated()

    @staticmethod
    def split(dim: int, full_size: int, tp_size: int) -> Placement:
        _deprecated("ShardLayout.split", "Sharded.split")
        return Sharded.split(dim, full_size, tp_size)


class PaddedShardLayout:
    """``PaddedShardLayout.padded(dim, size, p)`` -> ``Sharded.split(dim, size, p, padded=True)``."""

    @staticmethod
    def padded(dim: int, full_size: int, tp_size: int) -> Placement:
        _deprecated("PaddedShardLayout.padded", "Sharded.split(..., padded=True)")
        return Sharded.split(dim, full_size, tp_size, padded=True)


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``tp_size`` (``placement.padded_size``)."""
    return padded_size(vocab_size, tp_size)


def vocab_range(vocab_size: int, rank: int, tp_size: int) -> Tuple[int, int]:
    """``[start, end)`` of the padded vocabulary rows ``rank`` holds."""
    per_rank = padded_size(vocab_size, tp_size) // tp_size
    return rank * per_rank, (rank + 1) * per_rank
