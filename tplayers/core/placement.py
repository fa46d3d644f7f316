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

``pieces(rank, size)`` answers "which rows of the dense tensor does this rank hold, and where in
its local tensor"; ``shard`` and ``unshard`` are built on it, and so is everything that moves
weights between dense and sharded form (``from_dense``/``to_dense``, checkpoints, safetensors,
``assert_matches_dense``). The divisibility rule (:func:`require_divisible`) and the KV-head rule
(:func:`kv_shards`) live here once.
"""
from __future__ import annotations

from dataclasses import dataclass
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
    "qkv_placement",
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
    (zero-padded up to a multiple of ``shards`` when ``padded``)."""

    size: int
    shards: int
    padded: bool = False

    @property
    def local_size(self) -> int:
        """Rows of this part in each rank's local tensor (padding included)."""
        return -(-self.size // self.shards)


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
            if not part.padded and part.size % part.shards:
                raise ValueError(f"a part of size {part.size} does not split into {part.shards} shards")

    # -- constructors ------------------------------------------------------------------------
    @staticmethod
    def split(dim: int, size: int, tp_size: int, *, padded: bool = False) -> "Sharded":
        """One part of ``size`` rows, one piece per rank (``padded``: size need not divide)."""
        return Sharded(dim, (Part(size, tp_size, padded),))

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
            if part.shards > size or size % part.shards:
                raise ValueError(f"{size} ranks' local tensors cannot hold a part cut into {part.shards} shards "
                                 f"(the TP degree must be a multiple of the shard count)")

    def pieces(self, rank: int, size: int) -> Tuple[Piece, ...]:
        self.check_size(size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a TP group of size {size}")
        out: List[Piece] = []
        full_off = local_off = 0
        for part in self.parts:
            chunk = part.local_size
            lo = (rank // (size // part.shards)) * chunk
            hi = min(lo + chunk, part.size)
            out.append(Piece(full_off + min(lo, part.size), local_off, max(hi - lo, 0)))
            full_off += part.size
            local_off += chunk
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
            stride = size // part.shards
            for j in range(part.shards):  # the first replica of each piece
                p = self.pieces(j * stride, size)[i]
                rows.append(locals_[j * stride].narrow(self.dim, p.local_start, p.length))
        return rows[0] if len(rows) == 1 else torch.cat(rows, dim=self.dim)


def qkv_placement(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, *, dim: int = 0,
                  layer: str = "attention") -> Sharded:
    """Fused ``[q; k; v]`` projection: q split by heads; k and v by :func:`kv_shards`."""
    require_divisible(num_heads, tp_size, layer, "num_heads")
    if num_heads % num_kv_heads:
        raise ValueError(f"{layer}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    kv = kv_shards(num_kv_heads, tp_size, layer, "num_kv_heads")
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    return Sharded.fused(dim, [q_rows, kv_rows, kv_rows], tp_size, [tp_size, kv, kv], layer=layer,
                         names=["q", "k", "v"])


