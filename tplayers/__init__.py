"""tplayers: Megatron-style tensor-parallel layers for PyTorch, on explicit groups.

The package reads bottom-up, one folder per floor; each floor imports only the floors below it
(``tests/test_layering.py`` checks it):

    core/     groups, placement (how every parameter maps to its dense tensor), comm, functional
    layers/   ColumnParallelLinear, RowParallelLinear, fused, vocabulary, norm, GPT-2 Conv1D
    models/   dense twins + configs, rng, vocab-parallel loss, blocks, ParallelGPT
    convert/  parallelize(model, plan): styles, the engine, one plan file per model family; 2-D meshes
    io/       DCP checkpoints that reshard, dense safetensors, atomic publish, safe unpickling
    testing/  the persistent rank world, assert_matches_dense
    bench/    timing harness and the overlap microbenchmark
    cli/      ``tplayers verify`` and ``tplayers bench``
"""
from .core.functional import column_parallel_linear, row_parallel_linear
from .core.fingerprint import CollectivesOutOfStep, RanksDiverged, set_collective_checks
from .core.dtensors import UnlabelledShard
from .core.groups import TPGroup, resolve_group
from .layers import (ColumnParallelEmbedding, ColumnParallelLinear, FusedColumnParallelLinear, ParallelExperts, ParallelLMHead, ParallelNorm,
                     RowParallelLinear, TensorParallelModule, VocabParallelEmbedding, declare_siblings)
from .models.dense import BlockConfig, GPTConfig
from .models.rng import RNGTracker
from .models.loss import vocab_parallel_cross_entropy
from .models.blocks import ParallelAttention, ParallelMLP, ParallelTransformerBlock
from .models.moe import ParallelMoE
from .models.gpt import ParallelGPT
from .convert import AuditError, AuditReport, CoverageReport, Plan, audit, auto_plan, coverage, parallelize
from .layers import (backward_dw, check_replicas, check_same_inputs, check_same_output_grads, clip_grad_norm_, main_grads_to_grads, pending_wgrad,
                     set_overlap, use_main_grad, zero_main_grads)
from .core.wgrad import WeightGradStore
from .bench.accounting import CommAccounting, CommRecord, EmulatedLink, comm_accounting, emulated_link
from .bench.budget import BudgetComparison, CommBudget, megatron_budget
from .bench.hf_budget import megatron_budget_for_hf
from .bench.link import LinkModel, parse_link
from .convert.mesh2d import Mesh2D, make_2d_mesh
from .io import load_checkpoint, load_dense, save_checkpoint, save_dense
from . import testing

from ._version import __version__

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelModule",
    "TPGroup",
    "resolve_group",
    "column_parallel_linear",
    "row_parallel_linear",
    "testing",
    "VocabParallelEmbedding",
    "ColumnParallelEmbedding",
    "ParallelLMHead",
    "vocab_parallel_cross_entropy",
    "RNGTracker",
    "ParallelNorm",
    "FusedColumnParallelLinear",
    "declare_siblings",
    "ParallelExperts",
    "ParallelMLP",
    "ParallelMoE",
    "ParallelAttention",
    "ParallelTransformerBlock",
    "ParallelGPT",
    "BlockConfig",
    "GPTConfig",
    # drop-in, checkpoints, 2-D parallelism
    "parallelize", "coverage", "CoverageReport", "audit", "AuditError", "AuditReport", "auto_plan",
    "set_collective_checks", "CollectivesOutOfStep", "RanksDiverged", "UnlabelledShard",
    "set_overlap", "backward_dw", "pending_wgrad", "WeightGradStore",
    "use_main_grad", "main_grads_to_grads", "zero_main_grads",
    "clip_grad_norm_",
    "check_replicas",
    "check_same_inputs", "check_same_output_grads",
    "comm_accounting",
    "CommAccounting",
    "CommRecord",
    "megatron_budget",
    "megatron_budget_for_hf",
    "CommBudget",
    "BudgetComparison",
    "emulated_link",
    "EmulatedLink",
    "LinkModel",
    "parse_link",
    "Plan",
    "save_checkpoint",
    "load_checkpoint",
    "save_dense",
    "load_dense",
    "make_2d_mesh",
    "Mesh2D",
]
