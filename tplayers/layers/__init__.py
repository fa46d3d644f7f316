"""Floor 3, layers: nn.Modules over the core ops (linear, fused, vocabulary, norm, MoE experts, Mamba-2 mixers,
GPT-2 Conv1D)."""
from ..core.placement import require_divisible
from .base import TensorParallelModule, model_placements
from .switches import backward_dw, main_grads_to_grads, pending_wgrad, set_overlap, use_main_grad, zero_main_grads
from .linear import ColumnParallelLinear, RowParallelLinear
from .fused import FusedColumnParallelLinear
from .vocab import ParallelLMHead, VocabParallelEmbedding
from .column_embedding import ColumnParallelEmbedding
from .siblings import declare_siblings
from .norm import ParallelNorm
from .gradients import check_replicas, clip_grad_norm_
from .same_inputs import check_same_inputs, check_same_output_grads
from .lora import DoRAMagnitude, LoRAPiece
from .experts import ParallelExperts
from .mamba import ParallelMamba1, ParallelMamba2

__all__ = ["declare_siblings", "LoRAPiece", "DoRAMagnitude", "TensorParallelModule", "ColumnParallelLinear", "RowParallelLinear", "FusedColumnParallelLinear",
           "VocabParallelEmbedding", "ParallelLMHead", "ColumnParallelEmbedding", "ParallelNorm", "ParallelExperts", "ParallelMamba1", "ParallelMamba2", "model_placements", "set_overlap", "backward_dw", "pending_wgrad", "use_main_grad", "main_grads_to_grads", "zero_main_grads", "require_divisible",
           "clip_grad_norm_", "check_replicas", "check_same_inputs", "check_same_output_grads"]
