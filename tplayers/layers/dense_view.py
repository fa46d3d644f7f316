"""A TP module's parameters (or their gradients) as the dense model names and shapes them.

Sharded tensors are gathered through their placement (collective: every rank calls, in the same
order); replicated ones are taken as they are. Tied or shared parameters (one tensor under several
names, GPT-2's ``lm_head.weight`` and ``wte.weight``) appear once, under the first name
``nn.Module.named_parameters`` gives them, as in the dense model.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Set

import torch
import torch.nn as nn

from ..core.blocking import gather_placed
from .base import placements_of

__all__ = ["dense_parameters", "dense_tensors"]

# (qualified parameter name, the parameter) -> the local tensor to view densely (None: zeros)
Pick = Callable[[str, nn.Parameter], Optional[torch.Tensor]]


def dense_tensors(module: nn.Module, pick: Pick) -> Dict[str, torch.Tensor]:
    """``{parameter name: dense tensor}`` of ``pick(name, param)`` for every parameter of ``module``."""
    out: Dict[str, torch.Tensor] = {}
    _collect(module, pick, "", out, set())
    return out


def dense_parameters(module: nn.Module, *, grads: bool = False) -> Dict[str, torch.Tensor]:
    """Every parameter (or its gradient) of ``module`` as the dense model would name and shape it.

    Sharded parameters are gathered through their placement (collective: call on every rank);
    replicated ones are taken as they are. A GPT-2 ``Conv1D`` layer's weight is transposed back to
    the ``(in, out)`` its dense module stores. Tied parameters appear once (see the module docstring).
    """
    return dense_tensors(module, lambda name, p: p.grad if grads else p)


def _collect(module: nn.Module, pick: Pick, prefix: str, out: Dict[str, torch.Tensor], seen: Set[int]) -> None:
    placements = placements_of(module)
    for name, p in module.named_parameters(recurse=False):
        if id(p) in seen:  # tied: already taken under its first name
            continue
        seen.add(id(p))
        value = pick(prefix + name, p)
        value = (torch.zeros_like(p) if value is None else value).detach()
        placement = placements.get(name)
        if placement is not None and placement.is_sharded:
            value = gather_placed(value, placement, group=module.group)
        if name == "weight" and getattr(module, "dense_transposed", False):
            value = value.t()
        out[prefix + name] = value
    for child_name, child in module.named_children():
        _collect(child, pick, f"{prefix}{child_name}.", out, seen)
