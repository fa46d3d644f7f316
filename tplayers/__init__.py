"""tplayers: Megatron-style tensor-parallel layers for PyTorch, on explicit groups."""
from . import comm, functional, testing
from .functional import column_parallel_linear, row_parallel_linear
from .groups import TPGroup, resolve_group
from .layers import ColumnParallelLinear, RowParallelLinear, TensorParallelModule
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .loss import vocab_parallel_cross_entropy
from .rng import RNGTracker
from .norm import ParallelNorm
from .fused import FusedColumnParallelLinear
from .blocks import ParallelAttention, ParallelMLP, ParallelTransformerBlock
from .gpt import ParallelGPT
from .dense import BlockConfig, GPTConfig
from . import dense

from . import sharding
from .plan import Plan, parallelize
from .checkpoint import load_checkpoint, load_dense, save_checkpoint, save_dense
from .parallel2d import Mesh2D, make_2d_mesh

__version__ = "0.1.0"

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelModule",
    "TPGroup",
    "resolve_group",
    "column_parallel_linear",
    "row_parallel_linear",
    "comm",
    "functional",
    "testing",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "vocab_parallel_cross_entropy",
    "RNGTracker",
    "ParallelNorm",
    "FusedColumnParallelLinear",
    "ParallelMLP",
    "ParallelAttention",
    "ParallelTransformerBlock",
    "ParallelGPT",
    "BlockConfig",
    "GPTConfig",
    "dense",
    # drop-in, checkpoints, 2-D parallelism
    "parallelize",
    "Plan",
    "save_checkpoint",
    "load_checkpoint",
    "save_dense",
    "load_dense",
    "sharding",
    "make_2d_mesh",
    "Mesh2D",
]
