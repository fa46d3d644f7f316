"""Hugging Face GPTBigCode (StarCoder 1, SantaCoder): ``c_attn`` split by its layout, ``c_proj`` row,
``c_fc`` column, ``c_proj`` of the MLP row; the learned positions ``wpe`` stay replicated; the head is
tied to ``wte`` (both vocab-parallel, still one tensor).

The two ``c_attn`` layouts (``GPTBigCodeAttention.forward``):
- multi-query (``multi_query=True``, StarCoder): ``[q (num_heads * head_dim); k (head_dim); v (head_dim)]``:
  q split by heads, the single K/V head replicated on every rank, its gradient summed over the ranks
  (:class:`~tplayers.convert.styles.FusedQKV` with one KV head);
- multi-head: per head ``[q; k; v]`` (``view(b, s, num_heads, 3 * head_dim)``): a contiguous column
  split gives each rank whole heads.

A cross-attention (``add_cross_attention``) is not named by the plan: it stays whole on every rank
(correct; the coverage report lists it as dense).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch.nn as nn

from ...core.placement import require_divisible
from ..plan import Plan
from ..styles import BuildContext, Built, Column, FusedQKV

__all__ = ["PLAN", "BigCodeQKV"]


@dataclass(frozen=True)
class BigCodeQKV:
    """GPTBigCode's fused ``c_attn``, split by its layout (module docstring)."""

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        attn = ctx.parent
        require_divisible(attn.num_heads, ctx.group.size, f"parallelize: module '{ctx.name}'", "num_attention_heads")
        if attn.multi_query:
            return FusedQKV(heads="num_heads", kv_heads=1).build(module, ctx)
        return Column().build(module, ctx)  # contiguous output split = whole heads


def _local_heads(attn: nn.Module, tp_size: int) -> Dict[str, Any]:
    """What the attention reads to split and reshape ``c_attn``'s output, at this rank's heads."""
    heads = attn.num_heads // tp_size
    kv_heads = 1 if attn.multi_query else heads
    return {"num_heads": heads, "embed_dim": heads * attn.head_dim, "split_size": heads * attn.head_dim,
            "kv_heads": kv_heads, "kv_dim": kv_heads * attn.head_dim, "num_key_value_groups": heads // kv_heads}


PLAN = Plan(
    name="gpt_bigcode",
    layers={
        "*wte": "vocab_embedding",
        "*h.*.attn.c_attn": BigCodeQKV(),
        "*h.*.attn.c_proj": "row",
        "*h.*.mlp.c_fc": "column",
        "*h.*.mlp.c_proj": "row",
        "lm_head": "vocab_head",
    },
    set_attrs={"*h.*.attn": _local_heads},
)
