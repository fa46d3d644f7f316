"""transformers' tensor-parallel style names (4.48 .. 5.x) -> tplayers styles (:func:`translate_style`), and the
names ``"auto"`` recognises and leaves out, with the reason its coverage report gives.
"""
from __future__ import annotations

from typing import Callable, Dict, Union

from .sequence import ReplicateReduceGrad
from .styles import Column, KVColumn, Replicate, Row, Style
from .styles_vocab import VocabEmbedding
from .styles_whole import LatentKV

__all__ = ["EXPERTS_REPLICATED", "REPLICATED_EXPERTS", "HF_STYLES", "SKIPPED_STYLES", "translate_style"]

_KV_PROJECTIONS = ("k_proj", "v_proj")
REPLICATED_EXPERTS = "MoE experts stay replicated"
EXPERTS_REPLICATED = f"{REPLICATED_EXPERTS} (the plan does not split them): exact, but no memory saved"
# transformers' style names (4.48 .. 5.x) -> a tplayers style, by the last component of the module name.
HF_STYLES: Dict[str, Callable[[str], Style]] = {
    "colwise": lambda leaf: KVColumn() if leaf in _KV_PROJECTIONS else Column(),
    "local_colwise": lambda leaf: KVColumn() if leaf in _KV_PROJECTIONS else Column(),
    "rowwise": lambda leaf: Row(),
    "local_rowwise": lambda leaf: Row(),  # 4.5x: its sum came from a "gather" parent; Row all-reduces itself
    "colwise_rep": lambda leaf: Column(gather_output=True),
    "colwise_gather_output": lambda leaf: Column(gather_output=True),
    "rowwise_rep": lambda leaf: Row(input_is_parallel=False),
    "rowwise_split_input": lambda leaf: Row(input_is_parallel=False),
    "packed_colwise": lambda leaf: Column(parts=2),  # fused [gate; up]
    "embedding_rowwise": lambda leaf: VocabEmbedding(),
    "embedding_colwise": lambda leaf: VocabEmbedding(),  # same result; tplayers splits the vocabulary
    "replicated_with_grad_allreduce": lambda leaf: ReplicateReduceGrad(),
    "replicate": lambda leaf: Replicate(),
    "mla_kv_a_proj": lambda leaf: LatentKV(),
}

# Recognised names that "auto" leaves out, with the reason the coverage report gives.
SKIPPED_STYLES: Dict[str, str] = {
    "moe_tp_experts": EXPERTS_REPLICATED, "moe_identity_expert": EXPERTS_REPLICATED, "grouped_gemm": EXPERTS_REPLICATED, "ep_router": EXPERTS_REPLICATED,
    "local": EXPERTS_REPLICATED, "isolated": EXPERTS_REPLICATED, "local_packed_rowwise": EXPERTS_REPLICATED, "packed_rowwise": EXPERTS_REPLICATED,
    # transformers sums a module's partial output with these; every tplayers layer already returns a
    # complete output (its row layers all-reduce), so there is nothing left to sum.
    "gather": "its children's outputs are already complete (tplayers row layers all-reduce)",
    "all_reduce": "its children's outputs are already complete (tplayers row layers all-reduce)",
    "sequence_parallel": "the 'auto' plan is the plain TP layout: this norm sees the whole sequence (with "
                         "sequence_parallel=True, the variant derived from the module tree splits it)",
    "local_params": "its own parameters follow their own keys (one value per query head, e.g. sinks, styled "
                    "'colwise': read for this rank's heads; any other bare parameter refused); none here",
}


def translate_style(hf_style: Union[str, Style], module_name: str) -> Style:
    """The tplayers style for transformers' ``hf_style`` on module ``module_name`` (a tplayers style, from
    :data:`FAMILY_ADDITIONS`, as it is), or an error."""
    if not isinstance(hf_style, str):
        return hf_style
    if hf_style in HF_STYLES:
        return HF_STYLES[hf_style](module_name.rpartition(".")[2])
    raise ValueError(f"parallelize(model, 'auto'): module '{module_name}' has the unknown Hugging Face style "
                     f"'{hf_style}'; known: {sorted(HF_STYLES)}, left out: {sorted(SKIPPED_STYLES)}")
