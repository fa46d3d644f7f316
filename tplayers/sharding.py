"""Pure tensor functions between dense weights and TP shards: no communication, no modules built.

Everything here is driven by :class:`~tplayers.layers.ShardLayout` (how one parameter's full
tensor maps to rank r's local tensor). A *layout map* is ``{param_name: ShardLayout}`` for a whole
model; names absent from it are replicated.

    layouts = model_layouts(tp_model)                      # read off the TP modules, no comm
    local = shard_state_dict(full_sd, layouts, rank, tp)   # this rank's state dict
    full = unshard_state_dict([local_0, ..., local_p-1], layouts)
    locals_q = reshard_state_dict(locals_p, layouts_p, layouts_q)

Fused projections (q/k/v, gate/up) shard per component: see :func:`fused_layout`,
:func:`qkv_layout`. GPT-2's ``Conv1D`` stores its weight as ``(in, out)``, the transpose of
``nn.Linear``'s: :func:`conv1d_to_linear_weight` / :func:`linear_to_conv1d_weight`.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from .layers import ShardLayout, TensorParallelModule

__all__ = [
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


def model_layouts(model: nn.Module) -> Dict[str, ShardLayout]:
    """``{state_dict name: ShardLayout}`` for every parameter owned by a TP module of ``model``.

    Reads ``param_layouts()`` of each :class:`TensorParallelModule`; pure (no communication).
    """
    out: Dict[str, ShardLayout] = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, TensorParallelModule):
            prefix = f"{mod_name}." if mod_name else ""
            for pname, layout in mod.param_layouts().items():
                out[prefix + pname] = layout
    return out


def shard_state_dict(
    full: Mapping[str, torch.Tensor], layouts: Mapping[str, ShardLayout], rank: int, tp_size: int
) -> Dict[str, torch.Tensor]:
    """Rank ``rank``'s local state dict cut from a full (dense) one (views of ``full``, not copies).

    Names without a layout (or with a replicated one) map to the same tensor as in ``full``."""
    out = {}
    for name, t in full.items():
        layout = layouts.get(name)
        if layout is None or layout.dim is None:
            out[name] = t
            continue
        try:
            out[name] = layout.shard(t, rank, tp_size)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return out


def unshard_state_dict(
    locals_: Sequence[Mapping[str, torch.Tensor]], layouts: Mapping[str, ShardLayout]
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
        layout = layouts.get(name)
        pieces = [sd[name] for sd in locals_]
        try:
            out[name] = pieces[0] if layout is None else layout.unshard(pieces)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return out


def reshard_state_dict(
    locals_: Sequence[Mapping[str, torch.Tensor]],
    src_layouts: Mapping[str, ShardLayout],
    dst_layouts: Mapping[str, ShardLayout],
    dst_tp_size: int,
) -> List[Dict[str, torch.Tensor]]:
    """Local state dicts of a TP size ``len(locals_)`` model, re-cut for ``dst_tp_size`` ranks."""
    full = unshard_state_dict(locals_, src_layouts)
    return [shard_state_dict(full, dst_layouts, r, dst_tp_size) for r in range(dst_tp_size)]


def fused_layout(
    part_sizes: Sequence[int], tp_size: int, *, dim: int = 0, shards: Optional[Sequence[int]] = None
) -> ShardLayout:
    """Layout of a weight that concatenates ``part_sizes`` along ``dim``, each part split on its own.

    ``shards[i]`` (default ``tp_size``) is how many distinct pieces part i is cut into; fewer than
    ``tp_size`` means consecutive ranks hold replicas (GQA with fewer KV heads than ranks).
    """
    shards = [tp_size] * len(part_sizes) if shards is None else list(shards)
    if len(shards) != len(part_sizes):
        raise ValueError(f"{len(shards)} shard counts for {len(part_sizes)} parts")
    for size, n in zip(part_sizes, shards):
        if n < 1 or tp_size % n or size % n:
            raise ValueError(f"fused part of size {size} cannot be cut into {n} shards at TP degree {tp_size}")
    return ShardLayout(dim, tuple(zip(part_sizes, shards)))


def qkv_layout(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, *, dim: int = 0) -> ShardLayout:
    """Fused ``[q; k; v]`` projection layout: q split by heads; k and v split by heads, replicated
    when there are fewer KV heads than ranks (each rank keeps the KV head its query heads use)."""
    if num_heads % tp_size:
        raise ValueError(f"num_heads={num_heads} is not divisible by the TP degree {tp_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    kv_shards = tp_size if num_kv_heads % tp_size == 0 else num_kv_heads
    if tp_size % kv_shards:
        raise ValueError(f"num_kv_heads={num_kv_heads} neither divides nor is divisible by the TP degree {tp_size}")
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return fused_layout([q, kv, kv], tp_size, dim=dim, shards=[tp_size, kv_shards, kv_shards])


def fuse(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Concatenate separate projections (q, k, v or gate, up) into one fused dense weight."""
    return torch.cat(list(parts), dim=dim)


def split_fused(full: torch.Tensor, part_sizes: Sequence[int], dim: int = 0) -> List[torch.Tensor]:
    """Inverse of :func:`fuse`: the separate dense projections of a fused weight."""
    if full.shape[dim] != sum(part_sizes):
        raise ValueError(f"fused weight has size {full.shape[dim]} along dim {dim}, parts sum to {sum(part_sizes)}")
    return list(full.split(list(part_sizes), dim=dim))


def conv1d_to_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """GPT-2 ``Conv1D`` weight ``(in, out)`` -> ``nn.Linear`` weight ``(out, in)`` (a contiguous copy)."""
    if w.dim() != 2:
        raise ValueError(f"a Conv1D weight is 2-D, got shape {tuple(w.shape)}")
    return w.t().contiguous()


def linear_to_conv1d_weight(w: torch.Tensor) -> torch.Tensor:
    """``nn.Linear`` weight ``(out, in)`` -> GPT-2 ``Conv1D`` weight ``(in, out)`` (a contiguous copy)."""
    if w.dim() != 2:
        raise ValueError(f"a Linear weight is 2-D, got shape {tuple(w.shape)}")
    return w.t().contiguous()
