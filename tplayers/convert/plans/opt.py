"""Hugging Face OPT: q/k/v and fc1 column, out_proj and fc2 row; learned positions stay replicated."""
from __future__ import annotations

from ..plan import Plan, sequence_parallel_variant

PLAN = Plan(
    name="opt",
    layers={
        "*decoder.embed_tokens": "vocab_embedding",
        "*decoder.layers.*.self_attn.q_proj": "column",
        "*decoder.layers.*.self_attn.k_proj": "column",
        "*decoder.layers.*.self_attn.v_proj": "column",
        "*decoder.layers.*.self_attn.out_proj": "row",
        "*decoder.layers.*.fc1": "column",
        "*decoder.layers.*.fc2": "row",
        "lm_head": "vocab_head",
    },
    # OPT views q/k/v with num_heads; older versions also reshape with embed_dim.
    divide_attrs={"*decoder.layers.*.self_attn": ("num_heads", "embed_dim?")},
)

# OPT attention reads its input's (b, s) shape: it takes the gathered sequence (plain column q/k/v).
SP_PLAN = sequence_parallel_variant(
    PLAN, ["decoder.layers.0", "model.decoder.layers.0"],
    ["*decoder.layers.*.self_attn_layer_norm", "*decoder.layers.*.final_layer_norm"],
    ["decoder.final_layer_norm", "model.decoder.final_layer_norm"], gather_inputs=["*decoder.layers.*.self_attn"],
    keep=["*decoder.layers.*.self_attn.q_proj", "*decoder.layers.*.self_attn.k_proj",
          "*decoder.layers.*.self_attn.v_proj"])
