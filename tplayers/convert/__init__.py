"""Floor 5, convert: ``parallelize`` an existing model from a plan; TP x DP meshes.

    styles.py       the style contract (build(module, ctx) -> Built) and the layer-swapping styles
    sequence.py     sequence-parallel styles (scatter, gather, norms), replicated parameters with partial gradients
    plan.py         Plan (patterns -> styles, head-count attributes), style names, the SP variant
    plans/          one file per model family (llama, gpt2) and the registry
    auto.py         the "auto" plan: a Hugging Face model's own tp_plan translated to tplayers styles
    audit.py        the audit: each converted region vs its dense twin at the first forward
    twin.py         a region's dense twin, and running a region on a copy of its inputs
    causes.py       the likely causes of an audit mismatch
    coverage.py     CoverageReport: what parallelize did to a model (tplayers.coverage(model))
    parallelize.py  the engine: match -> check -> swap -> hooks
    mesh2d.py       make_2d_mesh: (dp, tp) DeviceMesh for TP x DDP / FSDP2
"""
from ..layers.conv1d import ColumnParallelConv1D, FusedColumnParallelConv1D, RowParallelConv1D, is_conv1d
from .audit import AuditReport, audit
from .audit_region import AuditError
from .auto import auto_plan
from .hf_styles import HF_STYLES, SKIPPED_STYLES
from .coverage import CoverageReport, coverage
from .mesh2d import Mesh2D, make_2d_mesh
from .parallelize import parallelize
from .plan import STYLE_NAMES, Plan, sequence_parallel_variant
from .plans import PLANS, SP_PLANS, get_plan
from .sequence import GatherSequence, PerHeadParams, ReplicateReduceGrad, ScatterSequence, SequenceParallelNorm
from .styles import BuildContext, Built, Column, FusedQKV, KVColumn, Replicate, Row, Style
from .styles_vocab import VocabEmbedding, VocabHead
from .styles_embedding import KVEmbedding
from .styles_whole import Experts, LatentKV, MambaMixer

__all__ = [
    "parallelize", "audit", "AuditError", "AuditReport", "Plan", "Style", "BuildContext", "Built", "STYLE_NAMES", "sequence_parallel_variant",
    "Column", "Experts", "FusedQKV", "KVColumn", "KVEmbedding", "LatentKV", "MambaMixer", "Row", "VocabEmbedding", "VocabHead", "Replicate",
    "SequenceParallelNorm", "ScatterSequence", "GatherSequence", "ReplicateReduceGrad", "PerHeadParams",
    "auto_plan", "HF_STYLES", "SKIPPED_STYLES", "CoverageReport", "coverage",
    "SP_PLANS", "PLANS", "get_plan",
    "ColumnParallelConv1D", "RowParallelConv1D", "FusedColumnParallelConv1D", "is_conv1d",
    "Mesh2D", "make_2d_mesh",
]
