"""Hugging Face Falcon (rotary, not ALiBi): fused ``query_key_value`` split by the layout the config
says, ``dense`` / ``dense_4h_to_h`` row, ``dense_h_to_4h`` column. ``FalconLinear`` computes a plain
linear by hand, which the styles accept after probing it.

The three qkv layouts (``FalconAttention._split_heads``):
- multi-query (Falcon-7B): ``[q heads; k; v]``, one KV head: q split by heads, k and v replicated on
  every rank (their gradients summed);
- ``new_decoder_architecture`` (40B, 180B): per KV group ``[q heads of the group; k; v]``: whole groups
  per rank (the KV heads must divide the TP degree);
- neither (multi-head): per head ``[q; k; v]``: whole heads per rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch.nn as nn

from ...core.placement import require_divisible
from ...layers.fused import FusedColumnParallelLinear
from ..plan import Plan
from ..styles import BuildContext, Built, Column

__all__ = ["PLAN", "FalconQKV"]


@dataclass(frozen=True)
class FalconQKV:
    """Falcon's fused ``query_key_value``, split by its layout (module docstring)."""

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        cfg, p = ctx.parent.config, ctx.group.size
        if getattr(cfg, "alibi", False):
            raise ValueError(f"parallelize: module '{ctx.name}': Falcon with ALiBi is not supported (its position "
                             "biases are built for all heads outside the attention); rotary Falcon is")
        require_divisible(cfg.num_attention_heads, p, f"parallelize: module '{ctx.name}'", "num_attention_heads")
        if cfg.new_decoder_architecture:
            require_divisible(cfg.num_kv_heads, p, f"parallelize: module '{ctx.name}'", "num_kv_heads")
        if cfg.new_decoder_architecture or not cfg.multi_query:
            return Column().build(module, ctx)  # contiguous output split = whole KV groups / whole heads
        Column().build(module, ctx)  # the same checks (an nn.Linear computing a plain linear)
        d = cfg.hidden_size // cfg.num_attention_heads
        return Built(FusedColumnParallelLinear.from_dense(module, group=ctx.group, parts=[cfg.hidden_size, d, d],
                                                          part_shards=[p, 1, 1]))


def _local_heads(attn: nn.Module, tp_size: int) -> Dict[str, Any]:
    """Falcon's attention reads ``num_heads`` (and, multi-head, ``num_kv_heads``) to split the qkv output, and
    (transformers >= 5.25) ``num_key_value_groups`` to repeat its KV heads: local heads / local KV heads."""
    heads, kv_heads = attn.num_heads // tp_size, getattr(attn, "num_kv_heads", 1)
    out: Dict[str, Any] = {"num_heads": heads}
    if attn.new_decoder_architecture or not attn.multi_query:
        kv_heads = out["num_kv_heads"] = attn.num_kv_heads // tp_size
    if hasattr(attn, "num_key_value_groups"):
        out["num_key_value_groups"] = heads // kv_heads
    return out


PLAN = Plan(
    name="falcon",
    layers={
        "*word_embeddings": "vocab_embedding",
        "*h.*.self_attention.query_key_value": FalconQKV(),
        "*h.*.self_attention.dense": "row",
        "*h.*.mlp.dense_h_to_4h": "column",
        "*h.*.mlp.dense_4h_to_h": "row",
        "lm_head": "vocab_head",
    },
    set_attrs={"*h.*.self_attention": _local_heads},
)
