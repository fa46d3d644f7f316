"""Hugging Face Persimmon (Adept's Persimmon-8B): fused ``query_key_value`` laid out per head
(``view(b, s, num_heads, 3, head_dim)``: each head's q, k and v rows side by side), so a contiguous
column split gives each rank whole heads; ``dense`` and ``dense_4h_to_h`` row, ``dense_h_to_4h``
column. ``q_layernorm`` / ``k_layernorm`` normalise over ``head_dim`` with one weight shared by every
head: replicated, and since each rank applies them to its own heads only, their gradients are summed
over the TP group (``replicate_reduce_grad``, as Qwen3's q/k norms)."""
from __future__ import annotations

from ..plan import Plan, local_head_attrs

__all__ = ["PLAN"]

PLAN = Plan(
    name="persimmon",
    layers={
        "*embed_tokens": "vocab_embedding",
        "*layers.*.self_attn.query_key_value": "column",
        "*layers.*.self_attn.dense": "row",
        "*layers.*.self_attn.q_layernorm": "replicate_reduce_grad",
        "*layers.*.self_attn.k_layernorm": "replicate_reduce_grad",
        "*layers.*.mlp.dense_h_to_4h": "column",
        "*layers.*.mlp.dense_4h_to_h": "row",
        "lm_head": "vocab_head",
    },
    # the attention splits the fused output with num_heads; older versions also reshape with hidden_size
    divide_attrs={"*layers.*.self_attn": ("hidden_size?",)},
    require_divisible={"*layers.*.self_attn": ("config.num_attention_heads",)},
    set_attrs={"*layers.*.self_attn": local_head_attrs},
)
