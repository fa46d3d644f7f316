"""Model-wide switches: the overlap modes (:func:`set_overlap`), float32 ``main_grad`` accumulation
(:func:`use_main_grad` and its hand-off), and delayed weight gradients (:func:`backward_dw`)."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from ..regions.region import require_chunks
from ..core.wgrad import WeightGradStore
from .base import TensorParallelModule
from .optimizers import MAIN_GRAD_IN_USE

__all__ = ["set_overlap", "use_main_grad", "main_grads_to_grads", "zero_main_grads", "pending_wgrad",
           "backward_dw"]


def set_overlap(model: nn.Module, *, overlap_comm: Optional[bool] = None, split_backward: Optional[bool] = None,
                chunks: Optional[int] = None, delay_wgrad: Optional[bool] = None,
                collective_matmul: Optional[bool] = None) -> Dict[str, int]:
    """One model-wide switch for the overlap modes; ``None`` leaves a mode as each module has it.

    ``overlap_comm``: backward collectives asynchronous under the weight-gradient GEMMs (every TP
    layer's ``overlap_comm``; off = the same ops with blocking collectives, bit-identical results). ``split_backward``: modules that can run several
    layers' weight gradients under one collective (``ParallelMLP``, ``ParallelAttention``) do so.
    ``chunks``: those modules run their batch in that many chunks, each chunk's collectives in flight
    under the next chunk's compute (1 = unchunked). ``delay_wgrad``: every TP linear records its
    weight-gradient GEMMs during backward for :func:`backward_dw` to run later.
    ``collective_matmul``: every sequence-parallel TP linear runs its forward all-gather /
    reduce-scatter (and the row layer its backward all-gather) as p ring steps under its GEMMs
    (layers without sequence parallelism are left alone; fused regions then run as their two
    layers). Returns how many modules each setting reached."""
    counts = {"overlap_comm": 0, "split_backward": 0, "chunks": 0, "delay_wgrad": 0, "collective_matmul": 0}
    if chunks is not None:
        require_chunks(chunks, "set_overlap")
    for name, value in (("overlap_comm", overlap_comm), ("split_backward", split_backward), ("chunks", chunks),
                        ("delay_wgrad", delay_wgrad)):
        if value is None:
            continue
        if name == "delay_wgrad" and not value and pending_wgrad(model):
            raise RuntimeError(f"set_overlap: delay_wgrad=False with {pending_wgrad(model)} recorded weight-gradient "
                               "computations not run yet: call tplayers.backward_dw(model) first")
        for module in model.modules():
            if isinstance(module, TensorParallelModule) and hasattr(module, name):
                setattr(module, name, value if name == "chunks" else bool(value))
                counts[name] += 1
    if collective_matmul is not None:
        for module in model.modules():
            if hasattr(module, "collective_matmul") and getattr(module, "sequence_parallel", False):
                module.collective_matmul = bool(collective_matmul)
                counts["collective_matmul"] += 1
    return counts


def use_main_grad(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Give every TP linear's weight and bias a zeroed ``main_grad`` buffer of ``dtype`` and make the
    weight-gradient GEMMs accumulate into it (Megatron's gradient_accumulation_fusion): ``.grad`` of
    those parameters stays None. Rows replicated over ranks (fewer KV heads than ranks) gain each
    backward's contribution summed over their replica ranks, as ``.grad`` would (per backward, one
    all-reduce per run of such rows for the weight and one for the bias). Hand-off: :func:`main_grads_to_grads` before the optimizer step,
    :func:`zero_main_grads` after it. Returns how many layers it set."""
    count = 0
    MAIN_GRAD_IN_USE[0] = True
    for module in model.modules():
        if not hasattr(module, "accumulate_main_grad"):
            continue
        for p in (module.weight, module.bias):
            if p is not None and getattr(p, "main_grad", None) is None:
                p.main_grad = torch.zeros(p.shape, dtype=dtype, device=p.device)
        module.accumulate_main_grad = True
        count += 1
    return count


def _main_grad_params(model: nn.Module) -> List[nn.Parameter]:
    return [p for p in model.parameters() if getattr(p, "main_grad", None) is not None]


def main_grads_to_grads(model: nn.Module) -> int:
    """Hand the accumulated ``main_grad`` buffers to a torch optimizer: ``p.grad`` becomes the buffer
    itself when the dtypes agree (float32 parameters: no copy) or a cast copy (bfloat16 parameters:
    the accumulation was in float32, the hand-off rounds once). Returns how many parameters."""
    params = _main_grad_params(model)
    for p in params:
        p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
    return len(params)


def zero_main_grads(model: nn.Module) -> None:
    """Zero every ``main_grad`` buffer (after the optimizer step; ``optimizer.zero_grad`` does not)."""
    for p in _main_grad_params(model):
        p.main_grad.zero_()


def _stores(model: nn.Module) -> List[WeightGradStore]:
    return [m.wgrad_store for m in model.modules() if isinstance(getattr(m, "wgrad_store", None), WeightGradStore)]


def pending_wgrad(model: nn.Module) -> int:
    """How many recorded weight-gradient computations (``delay_wgrad``) wait in ``model``."""
    return sum(len(store) for store in _stores(model))


def backward_dw(model: nn.Module) -> int:
    """Run the weight-gradient work that layers built with ``delay_wgrad=True`` recorded during
    backward, accumulating into ``.grad`` (identical to the normal backward); returns how many
    computations ran. Collective under sequence parallelism and with replicated KV heads: call it on
    every rank of the TP group, before ``optimizer.step()`` and before clipping."""
    return sum(store.flush() for store in _stores(model))
