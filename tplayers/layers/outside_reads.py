"""`refuse_outside_reads`: a TP layer's sharded parameter read, at the model's first forward, by code outside
tplayers is refused, naming the parameter and the line that read it.

A sharded parameter is a plain tensor of this rank's rows under its dense name. Read by its own layer it is
right; read by the model's code as if it were whole it is silently wrong. The usual case: a head tied by
reading the embedding's weight (``F.linear(x, self.wte.weight)``, as OLMo and gemma_pytorch do): after a
vocabulary-parallel conversion the logits are ``vocab / p`` wide on each rank, and nothing fails until a loss
meets a target id past them (or never, in inference).

    Before                                      Now
    F.linear(x, wte.weight) -> (b, s, V/p)      first forward: ValueError naming 'wte.weight' and the line
    (no error)                                  (every rank: the same code runs on each)

How: during the model's first forward a ``TorchFunctionMode`` looks at each torch call's arguments for a
sharded parameter (their identities: a dict lookup per argument) and, when one is there, at who called: torch's
own frames and the standard library's are skipped, tplayers' frames (its layers, the audit) may read their
shards; any other caller is the model's own code, unless it is a method of the module holding the parameter (a TP layer built around
the family's own class reads its own shards). Metadata reads (``.shape``, ``.dtype``, ``.device``) are not reads of values.
Cost: the first forward only (the mode's Python call per torch op); later forwards run without it.
"""
from __future__ import annotations

import fnmatch
import sys
import sysconfig
from itertools import chain
from typing import Any, List, Optional, Sequence

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..regions.partial_sum import METADATA
from .base import ShardIndex, TensorParallelModule, sharded_parameters
from .same_inputs import in_pipeline_shape_inference

__all__ = ["refuse_outside_reads"]


_STDLIB = sysconfig.get_paths()["stdlib"]


def _passes_through(frame: Any) -> bool:
    """torch's frames, the standard library's (``copy.deepcopy``), this module's: they read on someone's behalf."""
    module = str(frame.f_globals.get("__name__", ""))
    if module == __name__ or module == "torch" or module.startswith("torch."):
        return True
    filename = frame.f_code.co_filename
    return filename.startswith(_STDLIB) and "site-packages" not in filename


def _owns(owner: Any, p: torch.Tensor) -> bool:
    return isinstance(owner, nn.Module) and (any(q is p for q in owner._parameters.values()) or (
        isinstance(owner, TensorParallelModule) and any(q is p for q in owner.parameters())))


def _reader(frame: Any, p: torch.Tensor) -> Optional[str]:
    """Where ``p`` is read, when the reader may not read it: None for tplayers' own code (the first caller
    that is neither torch nor the standard library) and for a call made, at any depth, by a method of the
    module holding ``p`` or of a TP module converted whole around it (an experts or Mamba mixer class of the
    model's family, and the functions it calls)."""
    where = None
    while frame is not None:
        if where is None and not _passes_through(frame):
            module = str(frame.f_globals.get("__name__", ""))
            if module == "tplayers" or module.startswith("tplayers."):
                return None
            where = f"{frame.f_code.co_filename}:{frame.f_lineno} (in {frame.f_code.co_name})"
        if _owns(frame.f_locals.get("self"), p):
            return None
        frame = frame.f_back
    return where


class _Watch(TorchFunctionMode):
    """Refuses a torch call, made by code outside tplayers, that takes a watched (sharded) parameter."""

    def __init__(self, shards: ShardIndex, model: str) -> None:
        super().__init__()
        self.shards, self.model = shards, model

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func not in METADATA:
            for a in chain(args, kwargs.values()):
                hit = self.shards.find(a) if isinstance(a, torch.Tensor) else None
                if hit is not None:
                    where = _reader(sys._getframe(1), hit[1])
                    if where is not None:
                        raise ValueError(_message(hit[0], a, func, where, self.model))
        return func(*args, **kwargs)


def _message(name: str, p: torch.Tensor, func: Any, where: str, model: str) -> str:
    what = getattr(func, "__name__", str(func))
    return (f"tplayers: {model}'s forward read {name} (shape {tuple(p.shape)}; a tensor-parallel layer's parameter, "
            f"which holds this rank's shard) with {what} at {where}, outside that layer: code that reads a TP layer's weight "
            "as if it were whole computes on this rank's rows only, with no error (a head tied by reading the "
            "embedding's weight, F.linear(x, wte.weight) as OLMo and gemma_pytorch do, gives logits vocab / p wide). "
            "Read it through its module instead (a head as an nn.Linear module sharing the embedding's weight, "
            "given 'vocab_head' in the plan), or leave that layer whole (out of the plan, or 'replicate'); "
            "parallelize(..., check_consistency=False) skips this check")


def refuse_outside_reads(model: nn.Module, allowed: Sequence[str] = ()) -> None:
    """Watch ``model``'s first forward (see the module docstring): a sharded parameter of one of its TP layers
    read by the model's own code raises ValueError naming it and the line. The hooks remove themselves after
    that forward. ``allowed``: parameter-name patterns whose reads the model's code makes by design, knowing they
    are this rank's shard (DeepSeek-V3's absorbed attention reads its own heads of ``wkv_b.weight``)."""
    sharded = [n for n, _ in sharded_parameters(model)]
    for pat in allowed:
        if not any(fnmatch.fnmatchcase(n, pat) for n in sharded):
            raise ValueError(f"parallelize(..., shard_reads={list(allowed)!r}): '{pat}' names no split parameter of "
                             f"{type(model).__name__} (split: {sharded[:6]}{' ...' if len(sharded) > 6 else ''})")
    handles: List[Any] = []
    active: List[_Watch] = []

    def start(module: nn.Module, args: Any) -> None:
        if module is not model or torch.compiler.is_compiling() or in_pipeline_shape_inference():
            return  # (a copy of the model made with its hooks, as the audit's float32 copy, is not watched)
        shards = ShardIndex(model, skip=allowed)
        for h in handles:
            h.remove()
        if shards:
            active.append(_Watch(shards, type(model).__name__))
            active[0].__enter__()
            handles.append(model.register_forward_hook(stop, always_call=True))

    def stop(module: nn.Module, *_: Any) -> None:
        if module is not model:
            return
        handles[-1].remove()
        if active:
            active.pop().__exit__(None, None, None)

    handles.append(model.register_forward_pre_hook(start))
