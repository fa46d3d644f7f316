"""Hugging Face Llama-family models (Llama, Mistral, Qwen2, Qwen3, Olmo, Gemma): q/k/v/gate/up column, o/down row."""
from __future__ import annotations

from ..plan import Plan, local_head_attrs, sequence_parallel_variant

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
    # transformers >= 4.48 reshapes with view(..., -1, head_dim); older versions (and attentions that keep
    # their own head counts) read these: they follow this rank's heads, KV heads replicated or not.
    divide_attrs={"*layers.*.self_attn": ("hidden_size?",)},
    require_divisible={"*layers.*.self_attn": ("config.num_attention_heads",)},
    set_attrs={"*layers.*.self_attn": local_head_attrs},
)

# HF Llama attention views q/k/v with its input's (b, s) shape, so it takes the gathered sequence
# (plain column q/k/v); o_proj reduce-scatters back into the split residual stream.
SP_PLAN = sequence_parallel_variant(
    PLAN, ["layers.0", "model.layers.0"], ["*layers.*.input_layernorm", "*layers.*.post_attention_layernorm"],
    ["norm", "model.norm"], gather_inputs=["*layers.*.self_attn"],
    keep=["*layers.*.self_attn.q_proj", "*layers.*.self_attn.k_proj", "*layers.*.self_attn.v_proj"])
