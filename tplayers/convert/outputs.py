"""What a converted Hugging Face model returns: every tensor of its output that holds this rank's part of a
whole one is labelled as a shard (a DTensor over the TP group, its dense shape), never passed on as the whole.

- ``hidden_states`` under sequence parallelism: the entries collected inside the split region are this rank's
  sequence chunks ``(b, s/p, h)`` -> ``(b, s, h)``, ``Shard(1)``;
- ``attentions`` (``output_attentions=True``, an eager attention): each layer's weights hold this rank's query
  heads ``(b, H/p, s, s)`` -> ``(b, H, s, s)``, ``Shard(1)``; heads split unevenly (padded local heads) have no
  DTensor and are refused, naming why;
- ``logits`` under ``loss_parallel`` (:mod:`.loss_parallel`).

Labels are views (no collective); ``full_tensor()`` gathers one. Hooks on the model ``parallelize`` converted.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from ..core.dtensors import as_dtensor, is_dtensor
from ..core.groups import TPGroup
from ..core.placement import Sharded

__all__ = ["label_split_outputs", "save_pretrained_whole"]


def _length(args: tuple, kwargs: dict) -> Optional[int]:
    """The call's sequence length (``input_ids`` or ``inputs_embeds``, dim 1)."""
    source = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    source = kwargs.get("inputs_embeds") if source is None else source
    return source.shape[1] if isinstance(source, torch.Tensor) and source.dim() >= 2 else None


def label_split_outputs(model: nn.Module, tp: TPGroup, sequence_parallel: bool) -> None:
    """A forward hook on ``model`` labelling its output's split hidden states (``sequence_parallel``) and
    attention weights (see the module docstring)."""
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        states = getattr(output, "hidden_states", None)
        seq = _length(args, kwargs)
        if sequence_parallel and isinstance(states, tuple) and seq is not None and seq % tp.size == 0:
            output.hidden_states = tuple(
                as_dtensor(t, Sharded.split(1, seq, tp.size), tp)
                if isinstance(t, torch.Tensor) and not is_dtensor(t) and t.dim() >= 2 and t.shape[1] * tp.size == seq
                else t for t in states)
        attentions = getattr(output, "attentions", None)
        if isinstance(attentions, tuple) and isinstance(heads, int):
            output.attentions = tuple(_label_heads(t, heads, tp) for t in attentions)
        return output

    model.register_forward_hook(hook, with_kwargs=True)


def _label_heads(t: Any, heads: int, tp: TPGroup) -> Any:
    if not isinstance(t, torch.Tensor) or is_dtensor(t) or t.dim() != 4 or t.shape[1] == heads:
        return t  # whole (a layer that is not split)
    if heads % tp.size or t.shape[1] * tp.size != heads:
        raise ValueError(f"output_attentions: a layer's attention weights hold {t.shape[1]} heads on this rank of "
                         f"{tp.size}, of {heads}: its heads are split unevenly (padded on some ranks), which no DTensor "
                         "over the TP group describes. Ask for attention weights at a TP degree that divides the "
                         "heads, or from the dense model")
    return as_dtensor(t, Sharded.split(1, heads, tp.size), tp)  # (b, H, s, s), Shard(1)


def save_pretrained_whole(model: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """A Hugging Face / PEFT model's ``save_pretrained`` after ``parallelize``: given the dense ``state_dict`` it is
    the library's own; without it the library would read ``state_dict()``, whose TP shards are DTensors (no
    safetensors file holds one), and fail deep inside safetensors: refused here, naming the route."""
    if kwargs.get("state_dict") is None:
        raise RuntimeError(
            f"{type(model).__name__}.save_pretrained on a tensor-parallel model: its state_dict() holds TP shards (as "
            "DTensors), which a Hugging Face / PEFT save cannot write. On every rank of the TP group: "
            "model.save_pretrained(path, state_dict=tplayers.io.dense_state_dict(model), is_main_process=rank == 0) "
            "(dense_state_dict gathers the shards: collective), or tplayers.save_dense(model, path)")
    return type(model).save_pretrained(model, save_directory, *args, **kwargs)
