"""Modes ``comm`` and ``comm_bwd``: the TP step's collectives alone, blocking, in the order it issues them.

The schedule is not written down here: it is recorded from one real overlapped step of the TP model
(`tplayers.comm_accounting`) and replayed on zero buffers of the same sizes: the activations' as
``(b, s, h)`` buffer (flat: the layers gather and scatter in the order the buffer lands), any other (the
parameter-gradient all-reduces of the block's norms under sequence parallelism and of replicated KV
heads) as a flat buffer of its size. ``comm_bwd``, the backward collectives the overlap can hide:
those the overlapped backward launched asynchronously and waited for later (a blocking
collective's wait starts at its launch).
"""
from __future__ import annotations

import functools
from typing import Callable, List, Tuple

import torch

from ..core.blocking import all_gather_tensor, all_reduce_, reduce_scatter_tensor
from ..core.groups import TPGroup
from .accounting import CommRecord, comm_accounting
from .config import BenchConfig
from .timing import sync


__all__ = ["record_collectives", "comm_steps"]

Step = Callable[[], None]


def record_collectives(step: Step, device: torch.device) -> List[CommRecord]:
    """The collectives one run of ``step`` issues (collective: every rank of the step's group runs it)."""
    with comm_accounting() as acct:
        step()
        sync(device)
    return acct.records


def _run_all(ops: List[Step]) -> None:
    for op in ops:
        op()


def _replay(record: CommRecord, activation: torch.Tensor, g: TPGroup) -> Step:
    """``record``'s collective on zeros (reducing them in place keeps them zeros: no overflow, no denormals), flat:
    the bytes alone, no reordering copy (the layers gather and scatter rank-major, as the buffer lands)."""
    dim = 0
    full = activation.view(-1)  # (b * s * h,)
    if record.nbytes != activation.numel() * activation.element_size():
        full = activation.new_zeros(-(-record.nbytes // activation.element_size()))  # flat
    if record.op == "all_reduce":
        return lambda: all_reduce_(full, group=g)
    if record.op == "reduce_scatter":
        return lambda: reduce_scatter_tensor(full, dim, group=g)
    if record.op == "all_gather":  # nbytes: the gathered buffer; this rank sends its 1/p
        shard = full.narrow(dim, 0, full.shape[dim] // g.size).clone()  # flat
        return lambda: all_gather_tensor(shard, dim, group=g)
    raise ValueError(f"bench: cannot replay a {record.op} alone (modes comm, comm_bwd)")


def comm_steps(records: List[CommRecord], cfg: "BenchConfig", g: TPGroup, dtype: torch.dtype,
               device: torch.device) -> Tuple[Step, Step]:
    """The recorded collectives replayed alone: (all of fwd+bwd, the backward ones the overlap can hide)."""
    activation = torch.zeros(cfg.batch, cfg.seq, cfg.hidden, dtype=dtype, device=device)  # (b, s, h)
    ops = [_replay(r, activation, g) for r in records]
    hideable = [op for op, r in zip(ops, records) if r.phase == "backward" and r.wait_started != r.launched]
    return functools.partial(_run_all, ops), functools.partial(_run_all, hideable)
