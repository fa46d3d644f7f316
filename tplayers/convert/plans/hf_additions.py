"""What ``"auto"`` adds to transformers' own tensor-parallel plans, by ``config.model_type``: entries the plans
miss (attention of families whose plan omits it, shared experts, Mamba mixers, per-head gates), and the families
whose experts cannot run whole per rank.
"""
from __future__ import annotations

from typing import Dict, Union

from ..sequence import PerHeadParams
from ..styles import Style
from ..styles_whole import MambaMixer

__all__ = ["ADDED_ONCE", "FAMILY_ADDITIONS", "NO_WHOLE_EXPERTS", "ffn_split_from_ep_plan"]

# tplayers' own (no transformers plan names it): a parameter of the experts added after their down projection,
# kept whole and added by one rank (ParallelExperts' added_once)
ADDED_ONCE = "added_once"

LLAMA_ATTENTION = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                   "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}

# Entries transformers' own plans miss, by ``config.model_type``: the shared expert of Qwen2-MoE is
# a dense MLP (HF's plan names ``mlp.gate_proj``, which that model does not have); Apertus' activation.
FAMILY_ADDITIONS: Dict[str, Dict[str, Union[str, Style]]] = {
    "qwen2_moe": {"layers.*.mlp.shared_expert.gate_proj": "colwise", "layers.*.mlp.shared_expert.up_proj": "colwise",
                  "layers.*.mlp.shared_expert.down_proj": "rowwise",
                  "layers.*.mlp.shared_expert_gate": "replicate"},  # Linear(h, 1): a scalar gate per token
    # DeepSeek-V3's own plan names no attention: multi-head latent attention as DeepSeek-V2's plan splits it
    "deepseek_v3": {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.q_b_proj": "colwise",
                    "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj", "layers.*.self_attn.kv_b_proj": "colwise",
                    "layers.*.self_attn.o_proj": "rowwise"},
    # Phi-3.5-MoE's and Granite-MoE's own plans name their experts only: their attention is Llama's
    "phimoe": {**LLAMA_ATTENTION, "layers.*.mlp.router": "replicate"},
    "granitemoe": LLAMA_ATTENTION,
    # (and Granite's shared expert: one packed [gate; up] projection, then the down projection)
    "granitemoeshared": {**LLAMA_ATTENTION, "layers.*.shared_mlp.input_linear": "packed_colwise",
                         "layers.*.shared_mlp.output_linear": "rowwise"},
    # hybrid (Mamba / linear-attention) MoE families whose own plans name their routed experts only: their
    # attention layers, dense MLPs and shared experts are Llama's; Mamba-2 mixers split by heads, Jamba's Mamba-1
    # mixers by channels
    "granitemoehybrid": {**LLAMA_ATTENTION, "layers.*.shared_mlp.input_linear": "packed_colwise",
                         "layers.*.shared_mlp.output_linear": "rowwise", "layers.*.mamba": MambaMixer()},
    "jamba": {**LLAMA_ATTENTION, "layers.*.feed_forward.gate_proj": "colwise", "layers.*.feed_forward.up_proj": "colwise",
              "layers.*.feed_forward.down_proj": "rowwise", "layers.*.mamba": MambaMixer()},
    "nemotron_h": {"layers.*.mixer.q_proj": "colwise", "layers.*.mixer.k_proj": "colwise",
                   "layers.*.mixer.v_proj": "colwise", "layers.*.mixer.o_proj": "rowwise",
                   "layers.*.mixer.up_proj": "colwise", "layers.*.mixer.down_proj": "rowwise",
                   "layers.*.mixer.shared_experts.up_proj": "colwise",
                   "layers.*.mixer.shared_experts.down_proj": "rowwise",
                   "layers.*.mixer": MambaMixer(mixers_only=True)},  # (every layer's mixer is named 'mixer')
    # AFMoE's own plan names its routed experts only: a Llama attention with q/k norms and a sigmoid output gate
    # cut by heads like q_proj (below), dense first layers and shared experts Llama's MLP
    "afmoe": {**LLAMA_ATTENTION, "layers.*.self_attn.gate_proj": "colwise",
              "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
              "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
              "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
              "layers.*.mlp.shared_experts.gate_proj": "colwise", "layers.*.mlp.shared_experts.up_proj": "colwise",
              "layers.*.mlp.shared_experts.down_proj": "rowwise", "layers.*.mlp.router.gate": "replicate"},
    # Hunyuan-MoE's likewise: a Llama attention with per-head-dim q/k norms, Llama MLP shared experts
    "hunyuan_v1_moe": {**LLAMA_ATTENTION, "layers.*.self_attn.query_layernorm": "replicated_with_grad_allreduce",
                       "layers.*.self_attn.key_layernorm": "replicated_with_grad_allreduce",
                       "layers.*.mlp.shared_mlp.gate_proj": "colwise", "layers.*.mlp.shared_mlp.up_proj": "colwise",
                       "layers.*.mlp.shared_mlp.down_proj": "rowwise", "layers.*.mlp.gate.wg": "replicate"},
    # Bamba's own plan names only the embedding: its attention and MLPs are Llama's, its Mamba-2 mixers Granite's
    "bamba": {**LLAMA_ATTENTION, "layers.*.feed_forward.gate_proj": "colwise",
              "layers.*.feed_forward.up_proj": "colwise", "layers.*.feed_forward.down_proj": "rowwise",
              "layers.*.mamba": MambaMixer()},
    # Falcon-H1's own plan names only the embedding: attention and Mamba-2 mixer side by side in every layer,
    # Llama's attention and MLP names (its muP multipliers are scalars, its mixer's mup_vector cut with in_proj)
    "falcon_h1": {**LLAMA_ATTENTION, "layers.*.feed_forward.gate_proj": "colwise",
                  "layers.*.feed_forward.up_proj": "colwise", "layers.*.feed_forward.down_proj": "rowwise",
                  "layers.*.mamba": MambaMixer()},
    # Qwen3-VL's text tower: its own plan names only the embedding (18% of a tiny tower split, its layers whole);
    # its layers are Qwen3's (per-head q / k norms), so Qwen3's plan
    "qwen3_vl_text": {**LLAMA_ATTENTION, "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                      "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
                      "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
                      "layers.*.mlp.down_proj": "rowwise"},
    # Cohere (Command R+, use_qk_norm): its q / k norms hold one weight row per head, (heads, head_dim) and
    # (kv_heads, head_dim), applied to the heads q_proj / k_proj split: each rank reads its heads' rows
    "cohere": {"layers.*.self_attn.q_norm": PerHeadParams(("weight",)),
               "layers.*.self_attn.k_norm": PerHeadParams(("weight",), kv=True)},
    # LongCat-Flash's router is an nn.Linear classifier: replicated on purpose
    "longcat_flash": {"layers.*.mlp.router.classifier": "replicate"},
    # Llama 4's router is an nn.Linear(h, experts): replicated on purpose (every rank routes identically)
    "llama4_text": {"layers.*.feed_forward.router": "replicate"},
    # Apertus' xIELU activation has learnable scalars (alpha_p, alpha_n) between up_proj and down_proj: on
    # split activations each rank's gradient is a partial sum (found by the audit)
    "apertus": {"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"},
    # gpt-oss's own plan names only the embedding. Its attention is Llama's plus one learnable sink per head;
    # its experts are laid out (experts, in, out) with [gate, up] interleaved feature by feature, so a contiguous
    # cut of 2 * ffn keeps each gate beside its up; their biases: the up's split with it, the down's added once
    "gpt_oss": {**LLAMA_ATTENTION, "layers.*.self_attn": PerHeadParams(("sinks",)),
                "layers.*.mlp.router": "replicate", "layers.*.mlp.experts": "moe_tp_experts",
                "layers.*.mlp.experts.gate_up_proj": "rowwise", "layers.*.mlp.experts.gate_up_proj_bias": "rowwise",
                "layers.*.mlp.experts.down_proj": "colwise", "layers.*.mlp.experts.down_proj_bias": ADDED_ONCE},
}

# Families whose experts cannot run whole experts per rank, and why
NO_WHOLE_EXPERTS: Dict[str, str] = {
    "gpt_oss": "transformers' gpt-oss experts one-hot the routed expert ids over num_experts classes, so another "
               "rank's expert (the id num_experts, which other families' experts skip) cannot be routed past",
    "nemotron_h": "transformers' Nemotron-H experts one-hot the routed expert ids with room for another rank's "
                  "expert (the id num_experts), then run that id as one of their own experts (there is none)",
}


# transformers >= 5.25 names the routed experts in the expert-parallel plan only (``ep_dispatch_experts`` over
# ``grouped_gemm`` parameters). Split by each expert's ffn ("auto"'s default) they take the styles the tensor-
# parallel plans of 5.24 gave them, by parameter name (a layout that does not fit is left replicated: see
# tplayers.convert.auto._split_experts).
FFN_STYLES = {"gate_up_proj": "packed_colwise", "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
FFN_STYLES_BY_FAMILY = {  # by config.model_type (the text model's): Aria's laid out (experts, in, out), Inkling's
    # gate and up interleaved feature by feature (a contiguous cut keeps each gate beside its up)
    **{f: {"gate_up_proj": "packed_rowwise", "down_proj": "colwise"} for f in ("aria", "aria_text")},
    **{f: {"gate_up_proj": "colwise"} for f in ("inkling_text", "inkling2_text", "inkling2_loop_text")},
}


def ffn_split_from_ep_plan(ep: Dict[str, str], base: Dict[str, str], model_type: str) -> Dict[str, str]:
    """The experts ``ep`` (the expert-parallel plan) names that ``base`` (the tensor-parallel plan) does not, as
    tensor-parallel entries splitting each expert's ffn (``moe_tp_experts`` and a style per parameter)."""
    styles = {**FFN_STYLES, **FFN_STYLES_BY_FAMILY.get(model_type, {})}
    out: Dict[str, str] = {}
    for key, style in ep.items():
        if style != "ep_dispatch_experts" or key in base or any(k.startswith(key + ".") for k in base):
            continue
        out[key] = "moe_tp_experts"
        out.update({k: styles[k.rpartition(".")[2]] for k, st in ep.items()
                    if st == "grouped_gemm" and k.startswith(key + ".") and k.rpartition(".")[2] in styles})
    return out
