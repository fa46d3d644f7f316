"""Hugging Face Llama-family models (Llama, Mistral, Qwen2, Qwen3, Olmo, Gemma): q/k/v/gate/up column, o/down row."""
from __future__ import annotations

from ..plan import Plan, local_attention_attrs, sequence_parallel_variant
from ..styles import Column, KVColumn, Row

PLAN = Plan(
    name="llama",
    layers={
        "*embed_tokens": "vocab_embedding",
        # whole heads per rank, as evenly as possible when they do not divide the TP degree (head_parts)
        "*layers.*.self_attn.q_proj": Column(heads=True),
        "*layers.*.self_attn.k_proj": KVColumn(uneven=True),
        "*layers.*.self_attn.v_proj": KVColumn(uneven=True),
        "*layers.*.self_attn.o_proj": Row(heads=True),
        # Qwen3 / Gemma3: per-head norms on this rank's heads, gradients summed over the group
        "*layers.*.self_attn.q_norm": "replicate_reduce_grad",
        "*layers.*.self_attn.k_norm": "replicate_reduce_grad",
        "*layers.*.mlp.gate_proj": Column(uneven=True),
        "*layers.*.mlp.up_proj": Column(uneven=True),
        "*layers.*.mlp.down_proj": Row(uneven=True),
        "lm_head": "vocab_head",
    },
    # transformers >= 4.48 reshapes with view(..., -1, head_dim); older versions (and attentions that keep
    # their own head counts) read these: they follow this rank's (padded) heads, KV heads replicated or not.
    set_attrs={"*layers.*.self_attn": local_attention_attrs},
)

# HF Llama attention views q/k/v with its input's (b, s) shape, so it takes the gathered sequence
# (plain column q/k/v); o_proj reduce-scatters back into the split residual stream.
SP_PLAN = sequence_parallel_variant(
    PLAN, ["layers.0", "model.layers.0"], ["*layers.*.input_layernorm", "*layers.*.post_attention_layernorm"],
    ["norm", "model.norm"], gather_inputs=["*layers.*.self_attn"],
    keep=["*layers.*.self_attn.q_proj", "*layers.*.self_attn.k_proj", "*layers.*.self_attn.v_proj"])
