"""The placement contract: how one parameter of a TP module relates to its dense tensor.

Every parameter of a tensor-parallel model has exactly one placement (pure data, no communication):

- ``Replicated()``: every rank holds the whole dense tensor and computes its whole gradient
  (a row-parallel bias, a norm outside any sequence-parallel region).
- ``Replicated(partial_grad=True)``: every rank holds the whole tensor, but applies it to
  sharded activations (a norm under sequence parallelism), so each rank's gradient is a partial
  sum that must be all-reduced over the TP group.
- ``Sharded(dim, parts)``: rank r holds some rows (along ``dim``) of the dense tensor. The
  dense tensor is the concatenation along ``dim`` of ``parts`` (one part for a plain split;
  one per component for a fused q/k/v or gate/up projection, so a shard never straddles two
  components). Each :class:`Part` is cut into ``shards`` torch.chunk pieces; with fewer shards
  than ranks, ``size // shards`` consecutive ranks hold replicas of one piece (grouped-query
  attention with fewer KV heads than ranks), and with ``padded=True`` the part is padded with
  zero rows up to a multiple of ``shards`` (a vocabulary that does not divide the TP degree).
  A part may say how many consecutive ranks hold each piece (``holders``: 2 KV heads at TP 3 are
  held by 2 and 1 ranks). An *uneven* part gives the rows of each piece (``counts``): heads or ffn that do not divide the
  TP degree, split as evenly as possible (:func:`balanced`, :func:`head_parts`); every local
  tensor has the largest piece's rows, a shorter piece followed by zero rows. Local tensors keep
  one shape on every rank, so every collective stays as it is; the zero rows stay zero (the
  layers keep their gradient zero: a row-parallel layer masks its padded input features).

``pieces(rank, size)`` answers "which rows of the dense tensor does this rank hold, and where in
its local tensor"; ``shard`` and ``unshard`` are built on it, and so is everything that moves
weights between dense and sharded form (``from_dense``/``to_dense``, checkpoints, safetensors,
``assert_matches_dense``). The divisibility rule (:func:`require_divisible`) and the KV-head rule
(:func:`kv_shards`) live here once.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = [
    "Placement",
    "Replicated",
    "Sharded",
    "Part",
    "Piece",
    "require_divisible",
    "require_positive",
    "kv_shards",
    "padded_size",
    "balanced",
    "holder_slot",
    "uneven_part",
]


def require_divisible(size: int, tp_size: int, layer: str, what: str) -> int:
    """``size // tp_size``, or a ValueError naming the size, the TP degree and the layer.
    (``tp_size`` may also be a TPGroup, as 0.1 callers pass it.)"""
    tp_size = getattr(tp_size, "size", tp_size)
    require_positive(size, layer, what)
    if size % tp_size != 0:
        raise ValueError(f"{layer}: {what}={size} is not divisible by the TP degree {tp_size}")
    return size // tp_size


def require_positive(value: int, layer: str, what: str) -> int:
    """``value``, or a ValueError naming the layer and the argument when it is below 1."""
    if value < 1:
        raise ValueError(f"{layer}: {what}={value} must be positive")
    return value


def kv_shards(num_kv_heads: int, tp_size: int, layer: str = "attention", what: str = "n_kv_heads") -> int:
    """How many pieces the K and V heads are cut into at TP degree ``tp_size``.

    ``tp_size`` when the KV heads divide evenly (each rank holds ``num_kv_heads / p`` heads); with
    fewer KV heads than ranks, ``num_kv_heads``: each KV head is held by ``p / num_kv_heads``
    consecutive ranks (replicas), so every rank keeps the KV head its query heads use. Anything
    else cannot be split and raises, naming the layer, the count and the TP degree."""
    if num_kv_heads < 1:
        raise ValueError(f"{layer}: {what}={num_kv_heads} must be positive")
    if num_kv_heads >= tp_size:
        require_divisible(num_kv_heads, tp_size, layer, what)
        return tp_size
    if tp_size % num_kv_heads:
        raise ValueError(f"{layer}: {what}={num_kv_heads} is fewer than the TP degree {tp_size} and does not "
                         "divide it, so KV heads cannot be replicated evenly")
    return num_kv_heads


def padded_size(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple``."""
    return -(-size // multiple) * multiple


def balanced(units: int, pieces: int, unit: int = 1) -> Tuple[int, ...]:
    """Rows of each of ``pieces`` consecutive pieces of ``units`` whole units of ``unit`` rows, as even
    as possible: the first ``units % pieces`` pieces get one unit more (28 heads over 8: 4,4,4,4,3,3,3,3)."""
    if units < 0 or pieces < 1 or unit < 1:
        raise ValueError(f"balanced: cannot split {units} units of {unit} rows into {pieces} pieces")
    q, r = divmod(units, pieces)
    return tuple((q + (j < r)) * unit for j in range(pieces))


def holder_slot(holders: Sequence[int], rank: int) -> int:
    """Which piece rank ``rank`` holds, the pieces held by runs of ``holders[j]`` consecutive ranks
    (``(2, 1)``: ranks 0 and 1 hold piece 0, rank 2 piece 1); a ValueError past the last run."""
    for slot, end in enumerate(accumulate(holders)):
        if rank < end:
            return slot
    raise ValueError(f"rank {rank} is outside the {sum(holders)} ranks holding pieces {list(holders)}")


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, start + length)`` of the dense tensor (along the placement's dim) are rows
    ``[local_start, local_start + length)`` of this rank's local tensor."""

    start: int
    local_start: int
    length: int


@dataclass(frozen=True)
class Part:
    """One component of a sharded dimension: ``size`` dense rows cut into ``shards`` pieces
    (zero-padded up to a multiple of ``shards`` when ``padded``). ``counts``: an uneven cut, the rows
    of each piece in order (they sum to ``size``); each local tensor holds the largest, a shorter
    piece followed by zero rows. ``holders``: how many consecutive ranks hold each piece (they sum to
    the TP degree); None: ``p // shards`` each."""

    size: int
    shards: int
    padded: bool = False
    counts: Optional[Tuple[int, ...]] = None
    holders: Optional[Tuple[int, ...]] = None

    def holder_counts(self, size: int) -> Tuple[int, ...]:
        """How many consecutive ranks of a group of ``size`` hold each piece."""
        return self.holders if self.holders is not None else (size // self.shards,) * self.shards

    def piece_index(self, rank: int, size: int) -> int:
        """Which piece rank ``rank`` of a group of ``size`` holds."""
        return holder_slot(self.holder_counts(size), rank)

    def first_holders(self, size: int) -> Tuple[int, ...]:
        """The first rank holding each piece (the one that counts it, and the one unshard reads)."""
        return tuple(accumulate(self.holder_counts(size), initial=0))[:-1]

    def replica_sets(self, size: int) -> Tuple[Tuple[int, ...], ...]:
        """The ranks holding each piece (one rank each when every rank holds its own piece)."""
        return tuple(tuple(range(f, f + n)) for f, n in zip(self.first_holders(size), self.holder_counts(size)))

    @property
    def local_size(self) -> int:
        """Rows of this part in each rank's local tensor (padding included)."""
        if self.counts is not None:
            return max(self.counts)
        return -(-self.size // self.shards)

    @property
    def is_uneven(self) -> bool:
        """Some piece is shorter than the local tensor's rows (uneven counts, or a padded last chunk)."""
        return self.local_size * self.shards != self.size

    def piece(self, j: int) -> Tuple[int, int]:
        """``(start, length)`` of piece ``j`` in the part's dense rows."""
        if self.counts is not None:
            return sum(self.counts[:j]), self.counts[j]
        lo = min(j * self.local_size, self.size)
        return lo, min(lo + self.local_size, self.size) - lo


class Placement:
    """Base of :class:`Replicated` and :class:`Sharded` (see the module docstring). Subclasses
    define ``dim`` (None: not sharded) and ``partial_grad``."""

    dim: Optional[int]
    partial_grad: bool

    @property
    def is_sharded(self) -> bool:
        return self.dim is not None

    def pieces(self, rank: int, size: int) -> Tuple[Piece, ...]:
        raise NotImplementedError

    def full_shape(self, local_shape: Sequence[int]) -> Tuple[int, ...]:
        """The dense tensor's shape, from a local tensor's."""
        raise NotImplementedError

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank``'s local tensor cut from the dense one (pure; a view where possible)."""
        raise NotImplementedError

    def unshard(self, locals_: Sequence[torch.Tensor]) -> torch.Tensor:
        """The dense tensor rebuilt from every rank's local tensor, in rank order (pure)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Replicated(Placement):
    """The whole tensor on every rank; ``partial_grad``: its gradient must be summed over ranks."""

    partial_grad: bool = False

    @property
    def dim(self) -> Optional[int]:  # type: ignore[override]
        return None

    def pieces(self, rank: int, size: int) -> Tuple[Piece, ...]:
        return ()

    def full_shape(self, local_shape: Sequence[int]) -> Tuple[int, ...]:
        return tuple(local_shape)

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        return full

    def unshard(self, locals_: Sequence[torch.Tensor]) -> torch.Tensor:
        if not locals_:
            raise ValueError("unshard needs at least one rank's local tensor")
        return locals_[0]


@dataclass(frozen=True)
class Sharded(Placement):
    """Rows along ``dim`` split across ranks, part by part (see the module docstring)."""

    dim: int
    parts: Tuple[Part, ...]

    @property
    def partial_grad(self) -> bool:  # type: ignore[override]
        return False  # a sharded parameter's gradient is complete for the rows a rank holds

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a sharded placement needs at least one part")
        for part in self.parts:
            if part.shards < 1 or part.size < 0:
                raise ValueError(f"invalid part {part}")
            if part.counts is not None:
                if part.padded or len(part.counts) != part.shards or sum(part.counts) != part.size or \
                        min(part.counts) < 0:
                    raise ValueError(f"invalid uneven part {part}: counts must be {part.shards} rows, >= 0, summing "
                                     f"to {part.size} (and padded False: the counts say where the padding is)")
            elif not part.padded and part.size % part.shards:
                raise ValueError(f"a part of size {part.size} does not split into {part.shards} shards")
            if part.holders is not None and (len(part.holders) != part.shards or min(part.holders) < 1):
                raise ValueError(f"invalid part {part}: holders must give 1 or more ranks for each of its "
                                 f"{part.shards} pieces")

    # -- constructors ------------------------------------------------------------------------
    @staticmethod
    def split(dim: int, size: int, tp_size: int, *, padded: bool = False) -> "Sharded":
        """One part of ``size`` rows, one piece per rank (``padded``: size need not divide)."""
        return Sharded(dim, (Part(size, tp_size, padded),))

    @staticmethod
    def balanced(dim: int, size: int, tp_size: int, unit: int = 1) -> "Sharded":
        """One part of ``size`` rows in whole units of ``unit`` rows, one piece per rank, as evenly as
        possible (:func:`balanced`): a plain split when the units divide the TP degree."""
        if size % unit:
            raise ValueError(f"Sharded.balanced: size {size} is not whole units of {unit} rows")
        return Sharded(dim, (uneven_part(size, balanced(size // unit, tp_size, unit)),))

    @staticmethod
    def fused(dim: int, sizes: Sequence[int], tp_size: int, shards: Optional[Sequence[int]] = None,
              *, layer: str = "fused projection", names: Optional[Sequence[str]] = None) -> "Sharded":
        """Components of ``sizes`` back to back, each cut into ``shards[i]`` pieces (default
        ``tp_size``); a shard count must divide both its component and the TP degree."""
        shards = [tp_size] * len(sizes) if shards is None else [int(n) for n in shards]
        names = list(names) if names is not None else [f"part {i}" for i in range(len(sizes))]
        if not sizes or len(shards) != len(sizes) or len(names) != len(sizes):
            raise ValueError(f"{layer}: parts={list(sizes)}, part_shards={shards} and part_names={names} must be "
                             "non-empty and of equal length")
        for size, n, name in zip(sizes, shards, names):
            require_positive(size, layer, f"{name} size")
            if n < 1 or tp_size % n or size % n:
                raise ValueError(f"{layer}: {name} of size {size} cannot be cut into {n} shards at TP degree "
                                 f"{tp_size} (the shard count must divide both)")
        return Sharded(dim, tuple(Part(int(s), n) for s, n in zip(sizes, shards)))

    # -- the contract ------------------------------------------------------------------------
    @property
    def full_size(self) -> int:
        """Rows of the dense tensor along ``dim``."""
        return sum(part.size for part in self.parts)

    @property
    def local_size(self) -> int:
        """Rows of each rank's local tensor along ``dim``."""
        return sum(part.local_size for part in self.parts)

    def check_size(self, size: int) -> None:
        """Raise unless this placement can be laid over ``size`` ranks."""
        for part in self.parts:
            if part.holders is not None:
                if sum(part.holders) != size:
                    raise ValueError(f"{size} ranks' local tensors cannot hold a part whose pieces are held by "
                                     f"{list(part.holders)} ranks (they sum to {sum(part.holders)})")
            elif part.shards > size or size % part.shards:
                raise ValueError(f"{size} ranks' local tensors cannot hold a part cut into {part.shards} shards "
                                 f"(the TP degree must be a multiple of the shard count)")

    def pieces(self, rank: int, size: int) -> Tuple[Piece, ...]:
        self.check_size(size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a TP group of size {size}")
        out: List[Piece] = []
        full_off = local_off = 0
        for part in self.parts:
            start, length = part.piece(part.piece_index(rank, size))
            out.append(Piece(full_off + start, local_off, length))
            full_off += part.size
            local_off += part.local_size
        return tuple(out)

    def full_shape(self, local_shape: Sequence[int]) -> Tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full_size
        return tuple(shape)

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        if full.shape[self.dim] != self.full_size:
            raise ValueError(f"expected size {self.full_size} along dim {self.dim}, got {tuple(full.shape)}")
        pieces = self.pieces(rank, size)
        if self.local_size == sum(p.length for p in pieces):  # no padding: views, concatenated
            views = [full.narrow(self.dim, p.start, p.length) for p in pieces]
            return views[0] if len(views) == 1 else torch.cat(views, dim=self.dim)
        shape = list(full.shape)
        shape[self.dim] = self.local_size
        local = full.new_zeros(shape)
        for p in pieces:
            local.narrow(self.dim, p.local_start, p.length).copy_(full.narrow(self.dim, p.start, p.length))
        return local

    def unshard(self, locals_: Sequence[torch.Tensor]) -> torch.Tensor:
        size = len(locals_)
        if size == 0:
            raise ValueError("unshard needs at least one rank's local tensor")
        self.check_size(size)
        for r, t in enumerate(locals_):
            if t.shape[self.dim] != self.local_size:
                raise ValueError(f"rank {r}'s local tensor has size {t.shape[self.dim]} along dim {self.dim}, "
                                 f"the placement expects {self.local_size}")
        rows: List[torch.Tensor] = []
        for i, part in enumerate(self.parts):
            for first in part.first_holders(size):  # the first replica of each piece
                p = self.pieces(first, size)[i]
                rows.append(locals_[first].narrow(self.dim, p.local_start, p.length))
        return rows[0] if len(rows) == 1 else torch.cat(rows, dim=self.dim)


def uneven_part(size: int, counts: Sequence[int]) -> Part:
    """A part cut into ``counts`` rows per piece: a plain (torch.chunk) part when they are all equal."""
    counts = tuple(int(c) for c in counts)
    if len(set(counts)) == 1:
        return Part(size, len(counts))
    return Part(size, len(counts), counts=counts)
