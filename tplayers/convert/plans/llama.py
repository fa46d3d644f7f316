"""Hugging Face Llama-family models (Llama, Mistral, Qwen2, Qwen3, Olmo, Gemma): q/k/v/gate/up column, o/down row."""
from __future__ import annotations

from typing import Any, Dict

import torch.nn as nn

from ..plan import Plan, sequence_parallel_variant


def _local_kv_groups(attn: nn.Module, tp_size: int) -> Dict[str, Any]:
    """Query heads per KV head on one rank: unchanged when KV heads split evenly, else each rank
    holds one KV head (replicated) for its ``num_heads / p`` query heads."""
    heads, kv = attn.config.num_attention_heads, attn.config.num_key_value_heads
    if not hasattr(attn, "num_key_value_groups") or kv % tp_size == 0:
        return {}
    return {"num_key_value_groups": heads // tp_size}


PLAN = Plan(
    name="llama",
    layers={
        "*embed_tokens": "vocab_embedding",
        "*layers.*.self_attn.q_proj": "column",
        "*layers.*.self_attn.k_proj": "kv_column",
        "*layers.*.self_attn.v_proj": "kv_column",
        "*layers.*.self_attn.o_proj": "row",
        # Qwen3 / Gemma3: per-head norms on this rank's heads, gradients summed over the group
        "*layers.*.self_attn.q_norm": "replicate_reduce_grad",
        "*layers.*.self_attn.k_norm": "replicate_reduce_grad",
        "*layers.*.mlp.gate_proj": "column",
        "*layers.*.mlp.up_proj": "column",
        "*layers.*.mlp.down_proj": "row",
        "lm_head": "vocab_head",
    },
    # transformers >= 4.48 reshapes with view(..., -1, head_dim); older versions read these.
    divide_attrs={"*layers.*.self_attn": ("num_heads?", "num_key_value_heads?", "hidden_size?")},
    require_divisible={"*layers.*.self_attn": ("config.num_attention_heads",)},
    set_attrs={"*layers.*.self_attn": _local_kv_groups},
)

# HF Llama attention views q/k/v with its input's (b, s) shape, so it takes the gathered sequence
# (plain column q/k/v); o_proj reduce-scatters back into the split residual stream.
SP_PLAN = sequence_parallel_variant(
    PLAN, ["layers.0", "model.layers.0"], ["*layers.*.input_layernorm", "*layers.*.post_attention_layernorm"],
    ["norm", "model.norm"], gather_inputs=["*layers.*.self_attn"],
    keep=["*layers.*.self_attn.q_proj", "*layers.*.self_attn.k_proj", "*layers.*.self_attn.v_proj"])
