"""Whole-model state dicts between dense and TP form, pure (no communication); ``tplayers.io.state_dict``.

Driven by placements (:mod:`tplayers.core.placement`): a *placement map* is ``{param_name: Placement}``
for a whole model, read off its TP modules by :func:`model_placements`; names absent from it are
replicated.

    placements = model_placements(tp_model)                        # no communication
    local = shard_state_dict(full_sd, placements, rank, tp)        # this rank's state dict
    full = unshard_state_dict([local_0, ..., local_p-1], placements)
    locals_q = reshard_state_dict(locals_p, placements_p, placements_q, q)

Fused projections (q/k/v, gate/up) shard per component: :func:`fused_layout`, :func:`qkv_layout`.
GPT-2 ``Conv1D`` weights: :func:`~tplayers.layers.conv1d.conv1d_to_linear_weight` and its inverse.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

import torch

from ..core.placement import Placement, Sharded
from ..core.head_layout import qkv_placement
from ..layers.base import model_placements
from ..layers.conv1d import conv1d_to_linear_weight, linear_to_conv1d_weight

__all__ = [
    "model_placements",
    "model_layouts",
    "shard_state_dict",
    "unshard_state_dict",
    "reshard_state_dict",
    "fused_layout",
    "qkv_layout",
    "fuse",
    "split_fused",
    "conv1d_to_linear_weight",
    "linear_to_conv1d_weight",
]

model_layouts = model_placements  # the 0.1 name


def _named(name: str, fn, *args):  # noqa: ANN001, ANN202
    try:
        return fn(*args)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def shard_state_dict(
    full: Mapping[str, torch.Tensor], placements: Mapping[str, Placement], rank: int, tp_size: int
) -> Dict[str, torch.Tensor]:
    """Rank ``rank``'s local state dict cut from a full (dense) one (views of ``full`` where possible).

    Names without a placement (or with a replicated one) map to the same tensor as in ``full``."""
    out = {}
    for name, t in full.items():
        placement = placements.get(name)
        out[name] = t if placement is None else _named(name, placement.shard, t, rank, tp_size)
    return out


def unshard_state_dict(
    locals_: Sequence[Mapping[str, torch.Tensor]], placements: Mapping[str, Placement]
) -> Dict[str, torch.Tensor]:
    """The full state dict rebuilt from every rank's local one (given in rank order)."""
    if not locals_:
        raise ValueError("unshard_state_dict needs at least one rank's state dict")
    names = list(locals_[0])
    for r, sd in enumerate(locals_[1:], 1):
        if list(sd) != names:
            missing, extra = set(names) - set(sd), set(sd) - set(names)
            raise ValueError(f"rank {r}'s state dict differs from rank 0's: missing {sorted(missing)}, extra {sorted(extra)}")
    out = {}
    for name in names:
        placement = placements.get(name)
        pieces = [sd[name] for sd in locals_]
        out[name] = pieces[0] if placement is None else _named(name, placement.unshard, pieces)
    return out


def reshard_state_dict(
    locals_: Sequence[Mapping[str, torch.Tensor]],
    src_placements: Mapping[str, Placement],
    dst_placements: Mapping[str, Placement],
    dst_tp_size: int,
) -> List[Dict[str, torch.Tensor]]:
    """Local state dicts of a TP size ``len(locals_)`` model, re-cut for ``dst_tp_size`` ranks."""
    full = unshard_state_dict(locals_, src_placements)
    return [shard_state_dict(full, dst_placements, r, dst_tp_size) for r in range(dst_tp_size)]


def fused_layout(
    part_sizes: Sequence[int], tp_size: int, *, dim: int = 0, shards: Optional[Sequence[int]] = None
) -> Sharded:
    """Placement of a weight that concatenates ``part_sizes`` along ``dim``, each part split on its own.

    ``shards[i]`` (default ``tp_size``) is how many distinct pieces part i is cut into; fewer than
    ``tp_size`` means consecutive ranks hold replicas (GQA with fewer KV heads than ranks).
    """
    return Sharded.fused(dim, list(part_sizes), tp_size, shards)


def qkv_layout(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, *, dim: int = 0) -> Sharded:
    """Fused ``[q; k; v]`` projection placement (see :func:`~tplayers.core.head_layout.qkv_placement`)."""
    return qkv_placement(num_heads, num_kv_heads, head_dim, tp_size, dim=dim)


def fuse(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Concatenate separate projections (q, k, v or gate, up) into one fused dense weight."""
    return torch.cat(list(parts), dim=dim)


def split_fused(full: torch.Tensor, part_sizes: Sequence[int], dim: int = 0) -> List[torch.Tensor]:
    """Inverse of :func:`fuse`: the separate dense projections of a fused weight."""
    if full.shape[dim] != sum(part_sizes):
        raise ValueError(f"fused weight has size {full.shape[dim]} along dim {dim}, parts sum to {sum(part_sizes)}")
    return list(full.split(list(part_sizes), dim=dim))
