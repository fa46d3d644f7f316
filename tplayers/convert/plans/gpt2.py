"""Hugging Face GPT-2: ``Conv1D`` layers (weights stored transposed), the fused ``c_attn`` split per q/k/v."""
from __future__ import annotations

from ..plan import Plan, sequence_parallel_variant

PLAN = Plan(
    name="gpt2",
    layers={
        "*wte": "vocab_embedding",
        "*h.*.attn.c_attn": "fused_qkv",
        "*h.*.attn.c_proj": "row",
        "*h.*.mlp.c_fc": "column",
        "*h.*.mlp.c_proj": "row",
        "lm_head": "vocab_head",
    },
    divide_attrs={"*h.*.attn": ("num_heads", "split_size", "embed_dim")},
)

SP_PLAN = sequence_parallel_variant(PLAN, ["h.0", "transformer.h.0"], ["*h.*.ln_1", "*h.*.ln_2"],
                                    ["ln_f", "transformer.ln_f"])
