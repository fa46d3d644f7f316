"""Hugging Face StableLM (StableLM-2, StableLM-3B-4E1T, StableCode): Llama's layout (q/k/v, gate/up
column, o/down row; grouped-query attention, KV heads replicated when fewer than ranks) with layer
norms, and with ``qk_layernorm=True`` per-head q/k norms: ``StableLmLayerNormPerHead`` keeps one
``nn.LayerNorm`` per head in ``norms`` and applies ``norms[i]`` to head ``i`` of its input, zipping the
two. On a rank holding heads ``[a, b)`` the input has only those heads, so the dense forward would apply
``norms[0 .. b-a)`` to them (and silently drop the rest): :class:`LocalHeadNorms` makes it apply
``norms[a .. b)``. The norms stay whole on every rank (their state-dict names unchanged); each rank's
gradient covers only its heads' norms (zero for the others, or a partial sum for a KV head held by several
ranks), so the gradients are summed over the group. ``use_parallel_residual`` needs nothing more.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...core.comm import copy_to_tp
from ...core.groups import TPGroup
from ...core.placement import Replicated, kv_shards, require_divisible
from ...layers.base import PLACEMENTS_ATTR
from ..plan import Plan
from ..heads import attention_heads
from ..styles import BuildContext, Built, KVColumn
from . import llama

__all__ = ["PLAN", "LocalHeadNorms"]


def _head_norm(norm: nn.LayerNorm, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]
               ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``norm``'s forward with its parameters given (``nn.LayerNorm.forward``, the same call)."""
    return lambda x: F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)


@dataclass(frozen=True)
class LocalHeadNorms:
    """A per-head norm module (a ``norms`` ModuleList of ``nn.LayerNorm``, one per head, that its forward
    applies in head order to ``(b, heads, s, head_dim)``, StableLM's ``StableLmLayerNormPerHead``) applied
    to this rank's heads only: during its forward ``norms`` reads as the list of this rank's heads' norms.

    ``kv=False``: the query heads' norms (rank r holds heads ``[r * h/p, (r + 1) * h/p)``); ``kv=True``: the
    KV heads' norms, by the KV-head rule (:func:`~tplayers.core.placement.kv_shards`: fewer KV heads than
    ranks, each held by ``p / kv`` consecutive ranks). Head counts are read from the attention holding the
    module (:func:`~tplayers.convert.heads.attention_heads`). Every norm stays whole on every rank; their
    parameters enter the forward stacked through one ``copy_to_tp`` (one all-reduce of the stacked gradient,
    the same on every rank whichever heads it holds), placement ``Replicated(partial_grad=True)``."""

    kv: bool = False

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        layer = f"parallelize: module '{ctx.name}' (LocalHeadNorms)"
        norms = getattr(module, "norms", None)
        if not isinstance(norms, nn.ModuleList) or not all(type(n) is nn.LayerNorm for n in norms):
            raise TypeError(f"{layer}: expected a 'norms' ModuleList of nn.LayerNorm (one per head), got "
                            f"{type(norms).__name__}")
        heads, kv_heads = attention_heads(ctx.parent)
        count, what = (kv_heads, "num_key_value_heads") if self.kv else (heads, "num_attention_heads")
        if count is None or len(norms) != count:
            raise ValueError(f"{layer}: {len(norms)} norms, but the attention has {what}={count}")
        p = ctx.group.size
        if self.kv:
            shards = kv_shards(count, p, layer, what)  # KV heads fewer than ranks: replicas
        else:
            require_divisible(count, p, layer, what)
            shards = p
        per_shard, piece = count // shards, ctx.group.rank // (p // shards)
        local = list(range(piece * per_shard, (piece + 1) * per_shard))
        return Built(module, finish=lambda: _install(module, local, ctx.group),
                     label=f"{type(module).__name__} applying this rank's {'KV ' if self.kv else ''}heads' norms")


def _install(module: nn.Module, local: List[int], tp: TPGroup) -> None:
    if tp.size == 1:
        return
    for norm in module._modules["norms"]:
        setattr(norm, PLACEMENTS_ATTR, {n: Replicated(partial_grad=True) for n, _ in norm.named_parameters()})

    def stacked(norms: nn.ModuleList, name: str) -> Optional[torch.Tensor]:
        params = [getattr(norm, name) for norm in norms]
        return None if params[0] is None else copy_to_tp(torch.stack(params), group=tp)

    def pre_hook(m: nn.Module, args: Any) -> None:
        norms = m._modules["norms"]  # the module called: a copy (the audit's float32 one) has its own
        weight, bias = stacked(norms, "weight"), stacked(norms, "bias")
        m.__dict__["norms"] = [_head_norm(norms[i], None if weight is None else weight[i],
                                          None if bias is None else bias[i]) for i in local]

    def post_hook(m: nn.Module, args: Any, out: Any) -> None:
        m.__dict__.pop("norms", None)

    module.register_forward_pre_hook(pre_hook)
    module.register_forward_hook(post_hook, always_call=True)


# Llama's layout (q/k/v/o, gate/up/down, embedding, head, the attention's head counts), with StableLM's
# per-head q/k layer norms in place of Qwen3's q_norm / k_norm
PLAN = Plan(
    name="stablelm",
    layers={**{pattern: style for pattern, style in llama.PLAN.layers.items()
               if not pattern.endswith(("q_norm", "k_norm"))},
            "*layers.*.self_attn.q_layernorm": LocalHeadNorms(),
            "*layers.*.self_attn.k_layernorm": LocalHeadNorms(kv=True),
            # LocalHeadNorms picks each rank's heads' norms by the even split: heads must divide the TP degree,
            # KV heads divide it or be divided by it (kv_shards)
            "*layers.*.self_attn.k_proj": KVColumn(),
            "*layers.*.self_attn.v_proj": KVColumn()},
    require_divisible={"*layers.*.self_attn": ("config.num_attention_heads",)},
    set_attrs=dict(llama.PLAN.set_attrs),
)
