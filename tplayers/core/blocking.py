"""Blocking collectives on copies, for any ``group=`` (no autograd): rebuilding dense weights, coordination,
checks. Each is built on a primitive of :mod:`.collectives` (its observer, its fingerprint) and leaves its
input untouched (``all_reduce_`` is the one explicit in-place exception)."""
from __future__ import annotations

from typing import Sequence

import torch

from .collectives import REDUCE_OPS, all_gather, all_reduce, broadcast, owned_copy, reduce_scatter
from .digest import device_hash
from .fingerprint import pack_text, unpack_texts
from .groups import GroupLike, TPGroup, collective_device, is_fake, replica_group, replica_slot, resolve_group
from .placement import Placement

__all__ = ["sum_over_replica_ranks", "all_gather_tensor", "all_reduce_tensor", "barrier", "reduce_scatter_tensor", "all_reduce_", "broadcast_tensor", "gather_placed", "bit_hash", "bytes_hash", "ranks_that_differ", "all_gather_text"]


def all_gather_tensor(x: torch.Tensor, dim: int, *, group: GroupLike) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (no autograd). Used to rebuild dense weights."""
    with torch.no_grad():
        return all_gather(x.detach(), dim, resolve_group(group)).wait()


def all_reduce_tensor(x: torch.Tensor, *, group: GroupLike, op: str = "sum") -> torch.Tensor:
    """Sum (``op="sum"``) or maximum (``op="max"``) of ``x`` over the group as a new tensor
    (no autograd); ``x`` is left untouched."""
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce_tensor: op must be one of {sorted(REDUCE_OPS)}, got {op!r}")
    with torch.no_grad():
        g = resolve_group(group)
        return x.detach() if g.size == 1 else all_reduce(owned_copy(x.detach()), g, op=op).wait()


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
        return x.detach() if g.size == 1 else reduce_scatter(x.detach(), dim, g).wait()


def all_reduce_(x: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """Sum ``x`` over the group IN PLACE and return it (no autograd, no copy). Only for a buffer the
    caller owns outright (benchmarks timing the bare collective); everything else uses the copying ops."""
    g = resolve_group(group)
    if g.size == 1:
        return x
    if not x.is_contiguous():
        raise ValueError("all_reduce_: the buffer must be contiguous (a reduction into a copy would be lost)")
    with torch.no_grad():
        return all_reduce(x, g).wait()


def broadcast_tensor(x: torch.Tensor, src_rank: int, *, group: GroupLike) -> torch.Tensor:
    """``x`` of group rank ``src_rank``, on every rank, as a new tensor (no autograd)."""
    with torch.no_grad():
        g = resolve_group(group)
        return x.detach() if g.size == 1 else broadcast(owned_copy(x.detach()), src_rank, g).wait()


def gather_placed(local: torch.Tensor, placement: Placement, *, group: GroupLike) -> torch.Tensor:
    """The dense tensor of ``placement`` rebuilt on every rank from each rank's ``local`` (no
    autograd). A replicated placement returns ``local`` itself: no communication."""
    if not placement.is_sharded:
        return local.detach()
    g = resolve_group(group)
    gathered = all_gather_tensor(local.contiguous(), placement.dim, group=g)
    return placement.unshard(gathered.chunk(g.size, dim=placement.dim))


def bit_hash(t: torch.Tensor) -> torch.Tensor:
    """Two int64 hashes of ``t``'s bits (a plain and a position-weighted wrapping sum), on the CPU:
    equal tensors hash equal; a difference in any bit changes them (but for astronomically rare
    collisions). Works through 1M elements at a time, so memory stays small for any tensor."""
    return device_hash(t).cpu()


def bytes_hash(data: bytes) -> torch.Tensor:
    """:func:`bit_hash` of raw bytes (a path, a file's text): two int64, equal on every rank for equal bytes
    (unlike Python's ``hash`` of a str, which is salted per process)."""
    return bit_hash(torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8))


def ranks_that_differ(hashes: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """Every rank's ``hashes`` (n, k) gathered (one all-gather): ``(p, n)`` bool, True where a rank's
    row differs from rank 0's. The same answer on every rank, so all raise together."""
    g = resolve_group(group)
    if g.size == 1 or is_fake(g.process_group):  # a simulated group has no peers to disagree
        return torch.zeros(1, hashes.shape[0], dtype=torch.bool)
    every = all_gather_tensor(hashes[None].to(collective_device(g.process_group)), 0, group=g).cpu()  # (p, n, k)
    return (every != every[:1]).any(-1)


def all_gather_text(text: str, *, group: GroupLike, limit: int = 8192) -> "list[str]":
    """Every rank's ``text`` (UTF-8, cut to ``limit`` bytes), in rank order, on every rank: one
    all-gather of ``limit + 8`` bytes per rank. For errors that one rank found and every rank raises."""
    g = resolve_group(group)
    if g.size == 1 or is_fake(g.process_group):
        return [text]
    buf = pack_text(text, limit)
    return unpack_texts(all_gather_tensor(buf[None].to(collective_device(g.process_group)), 0, group=g).cpu())


def sum_over_replica_ranks(rows: torch.Tensor, g: TPGroup, holders: Sequence[int]) -> torch.Tensor:
    """``rows`` summed over the ranks that hold the same replica of them: the group's ranks in runs of
    ``holders[j]`` consecutive ranks (see :func:`replica_slot`). One all-reduce over the run's own group
    (:func:`replica_group`: a pair of ranks sends ``rows`` once, where the whole group would send
    ``2(p-1)/p`` of a buffer padded to ``len(holders)`` slots). Returns a new tensor."""
    sub = replica_group(g, holders)
    if sub is not None:
        return owned_copy(rows) if sub.size == 1 else all_reduce(owned_copy(rows), sub).wait()
    slot = replica_slot(holders, g)
    buf = rows.new_zeros((len(holders),) + tuple(rows.shape))
    buf[slot].copy_(rows)
    return all_reduce(buf, g).wait()[slot]
