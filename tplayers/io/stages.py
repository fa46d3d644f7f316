"""Pipeline stages in one checkpoint: each rank may hold a different part of the model (a stage of a pipeline,
torchtitan style: the full model's names, this stage's layers only). The checkpoint's index is every rank's
tensors merged; a load checks the ranks' tensors together, so the checkpoint reloads at another pipeline layout.

    Before                                            Now
    save_checkpoint(stage, path) on every rank:       the index lists every stage's tensors; a load at another
    the index held rank 0's stage only; the load      split (or whole, or TP) takes each rank's own from it;
    failed "missing from the checkpoint"              two ranks holding one name differently are refused
"""
from __future__ import annotations

import json
from typing import Any, Dict, List

import torch.distributed as dist

from ..core.fingerprint import exchange_text
from .walk import CheckpointError

__all__ = ["every_ranks", "merged_tensors"]


def every_ranks(pg: Any, value: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every rank's ``value`` (a JSON-able dict: its manifest's tensors, its optimizer's record, a verdict), in rank
    order (one exchange of their JSON)."""
    if pg is None:
        return [value]
    texts = exchange_text(json.dumps(value), pg, dist.get_world_size(pg), limit=None)  # (dicts keep their order)
    return [json.loads(t) for t in texts]


def merged_tensors(per_rank: List[Dict[str, Any]], caller: str) -> Dict[str, Any]:
    """The ranks' tensors as one index; a name two ranks hold with different full shapes or layouts is refused
    (the same on every rank: every rank merges every rank's)."""
    merged: Dict[str, Any] = {}
    owner: Dict[str, int] = {}
    for rank, tensors in enumerate(per_rank):
        for name, record in tensors.items():
            if name in merged and merged[name] != record:
                raise CheckpointError(f"{caller}: '{name}' is held by rank {owner[name]} as {merged[name]} and by rank "
                                      f"{rank} as {record}: the ranks saving one checkpoint must agree on every tensor "
                                      "they share (pipeline stages hold distinct names)")
            merged.setdefault(name, record)
            owner.setdefault(name, rank)
    return merged
