"""Logits split by vocabulary through the loss, for Hugging Face causal LMs (``parallelize(...,
loss_parallel=True)``).

Before: the LM head all-gathers the full logits ``(b, s, V)`` on every rank so that the model's own
loss can run: ``b * s * V`` numbers on the wire and in memory per rank (Llama 3's 128k vocabulary at
8k tokens: ~4 GB in float32). Now: when the model is called with ``labels``, the head keeps its
vocabulary shard ``(b, s, V'/p)`` and the model's loss is `vocab_parallel_cross_entropy` (two
all-reduces: the row maxima, then 2 or 3 numbers per row), as Megatron and DTensor's ``loss_parallel`` do. Without labels
(generation, evaluation) the head gathers as before: full logits whenever the caller asks for them.
With labels, the output's ``logits`` are that shard labelled as one: a DTensor of the dense shape
``(b, s, V)``, ``Shard(-1)`` over the TP group (a view, no collective), so ``argmax``, ``softmax`` or
``full_tensor()`` give the dense model's answers and nothing takes the shard for the whole vocabulary.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.dtensors import as_dtensor, is_dtensor
from ..core.groups import TPGroup
from ..core.placement import Sharded
from ..layers.vocab import ParallelLMHead
from ..models.loss import vocab_parallel_cross_entropy

__all__ = ["apply_loss_parallel"]


def apply_loss_parallel(model: nn.Module, tp: TPGroup, tp_invariant: bool = False) -> None:
    """Make ``model`` (a parallelized HF causal LM) compute its loss from vocabulary-split logits (``tp_invariant``:
    its sums as the fixed tree, `vocab_parallel_cross_entropy`'s ``tp_invariant``)."""
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead) and m.gather_output]
    if not hasattr(type(model), "loss_function") or len(heads) != 1:
        raise ValueError("parallelize(loss_parallel=True) needs a Hugging Face causal LM (a model with a "
                         f"`loss_function`) whose LM head became one ParallelLMHead; this model has "
                         f"{len(heads)} gathering ParallelLMHead(s) and "
                         f"{'a' if hasattr(type(model), 'loss_function') else 'no'} loss_function")
    head, vocab, dense_loss = heads[0], heads[0].num_embeddings, model.loss_function

    def loss_function(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                      num_items_in_batch: Optional[Any] = None, ignore_index: int = -100,
                      shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        """HF's ``ForCausalLMLoss`` (next-token targets, ``ignore_index``, a sum over
        ``num_items_in_batch`` when given, else the mean) over this rank's vocabulary shard."""
        if head.gather_output:  # labels passed positionally: the head gathered, the dense loss applies
            return dense_loss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                              ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if logits.dtype in (torch.float16, torch.bfloat16):  # upcast as HF does (float64 stays: HF's .float()
            logits = logits.float()                            # would round it; dense agrees to ~1e-7)
        # logits: (b, s, V'/p)
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # (b, s): the next token
        target = shift_labels.reshape(-1).to(logits.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), target, group=tp, vocab_size=vocab,
                                            ignore_index=ignore_index, reduction=reduction, tp_invariant=tp_invariant)
        if reduction == "sum":
            loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                           else num_items_in_batch)
        return loss

    def split_when_labelled(_: nn.Module, args: tuple, kwargs: dict) -> None:
        head.gather_output = kwargs.get("labels") is None

    def gather_again(_: nn.Module, args: tuple, output: Any) -> Any:  # after the forward, its loss included
        split, head.gather_output = not head.gather_output, True
        logits = getattr(output, "logits", None)
        if split and isinstance(logits, torch.Tensor) and not is_dtensor(logits) and tp.size > 1:
            output.logits = as_dtensor(logits, vocab_placement(logits.dim()), tp)  # (b, s, V), Shard(-1)
        return output

    def vocab_placement(dims: int) -> Sharded:
        weight = head.param_placements()["weight"]  # rows of the vocabulary (padded): the logits' last dim
        return Sharded(dims - 1, weight.parts)  # type: ignore[attr-defined]

    model.loss_function = loss_function
    model.register_forward_pre_hook(split_when_labelled, with_kwargs=True)
    model.register_forward_hook(gather_again, always_call=True)
