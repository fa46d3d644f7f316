"""Differentiable collectives over rows (dim 0), for token dispatch: tokens to their experts' ranks and back
(`all_to_all_rows`), a batch's rows split over the ranks and gathered again (`split_rows`, `gather_rows`:
uneven counts allowed). Each backward is its partner's ``apply`` (differentiable again), as in :mod:`.comm`.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .collectives import all_gather, all_to_all, owned_copy
from .groups import GroupLike, TPGroup, resolve_group

__all__ = ["all_to_all_rows", "split_rows", "gather_rows", "row_counts"]


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks ``send_rows`` says, rows from the ranks ``recv_rows`` says; backward the same
    exchange reversed (each row's gradient goes back to the rank that sent the row)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup, send_rows: Tuple[int, ...], recv_rows: Tuple[int, ...]) -> torch.Tensor:
        ctx.g, ctx.send, ctx.recv = g, send_rows, recv_rows
        return all_to_all(x, send_rows, recv_rows, g).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.g, ctx.recv, ctx.send), None, None, None


def row_counts(rows: int, parts: int) -> List[int]:
    """``rows`` split into ``parts`` as evenly as possible, the larger parts first (``torch.tensor_split``'s
    sizes): what :func:`split_rows` keeps on each rank."""
    return [rows // parts + (1 if r < rows % parts else 0) for r in range(parts)]


class _SplitRows(torch.autograd.Function):
    """Keep this rank's rows (dim 0, :func:`row_counts`: uneven allowed); backward gathers the rows' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup) -> torch.Tensor:
        ctx.g, ctx.rows = g, x.shape[0]
        return owned_copy(x.tensor_split(g.size, dim=0)[g.rank])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherRows.apply(grad, ctx.g, ctx.rows), None


class _GatherRows(torch.autograd.Function):
    """Every rank's rows (dim 0, :func:`row_counts` of ``rows``) concatenated in rank order: one all-gather,
    each rank's rows padded to the largest count; backward keeps this rank's rows of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: TPGroup, rows: int) -> torch.Tensor:
        ctx.g = g
        counts = row_counts(rows, g.size)
        if x.shape[0] != counts[g.rank]:
            raise ValueError(f"gather_rows: rank {g.rank} holds {x.shape[0]} rows; {rows} rows over {g.size} ranks "
                             f"are held as {counts}")
        padded = x.new_zeros((counts[0],) + tuple(x.shape[1:]))
        padded[:x.shape[0]] = x
        gathered = all_gather(padded, 0, g).wait().view((g.size, counts[0]) + tuple(x.shape[1:]))
        return torch.cat([gathered[r, :n] for r, n in enumerate(counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _SplitRows.apply(grad, ctx.g), None, None


def all_to_all_rows(x: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int], *,
                    group: GroupLike) -> torch.Tensor:
    """The rows of ``x`` (dim 0) to every rank in rank order (``send_rows[j]`` to rank j), the rows every
    rank sent this one back (``recv_rows[j]`` from rank j); backward the reverse exchange. The sizes must
    pair up across ranks (rank i's ``send_rows[j]`` is rank j's ``recv_rows[i]``): see
    :func:`tplayers.core.collectives.all_to_all`."""
    g = resolve_group(group)
    return x if g.size == 1 else _AllToAll.apply(x, g, tuple(int(n) for n in send_rows),
                                                 tuple(int(n) for n in recv_rows))


def split_rows(x: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """This rank's rows of ``x`` (dim 0, as evenly as possible: :func:`row_counts`), a copy; the gradient is
    gathered from every rank backward (``x`` is the same on every rank: its gradient becomes whole)."""
    g = resolve_group(group)
    return x if g.size == 1 else _SplitRows.apply(x, g)


def gather_rows(x: torch.Tensor, rows: int, *, group: GroupLike) -> torch.Tensor:
    """Every rank's rows of a ``rows``-row tensor held as :func:`split_rows` holds it, concatenated (one
    all-gather); backward keeps this rank's rows of the gradient (the same on every rank)."""
    g = resolve_group(group)
    return x if g.size == 1 else _GatherRows.apply(x, g, int(rows))
