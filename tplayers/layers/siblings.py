"""declare_siblings: column-parallel layers that a forward calls on one tensor (q/k/v, gate/up) reduce their
summed input gradient once (the mechanism: `tplayers.core.siblings`)."""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from ..core.siblings import ColumnInputs, Siblings
from .fused import FusedColumnParallelLinear
from .linear import ColumnParallelLinear
from .vocab import ParallelLMHead

__all__ = ["declare_siblings", "COLUMN_KINDS"]

COLUMN_KINDS = (ColumnParallelLinear, FusedColumnParallelLinear, ParallelLMHead)  # the layers a set can hold


def declare_siblings(*layers: nn.Module, inputs: Optional[ColumnInputs] = None) -> Siblings:
    """Declare column-parallel layers your forward calls on one tensor (an attention's q, k and v; an MLP's
    gate and up): in a backward their partial input gradients are summed and all-reduced (under sequence
    parallelism: reduce-scattered) once, instead of once per layer. ``parallelize`` declares the column layers
    of each region itself; an undeclared layer reduces its own.

    A declaration cannot make a gradient wrong: in each forward the members called on one input (that
    tensor, or a cast of it) share; a member called on another tensor (a cross-attention's k and v) reduces
    with those called on that one. ``inputs``: the model's :class:`~tplayers.core.siblings.ColumnInputs` (one
    per model: a call of one set at a time; the shard a module gathering its sequence for these layers offers,
    `tplayers.core.comm.gather_sequence_for_columns`); a new one if None.
    Returns the set (each layer's ``siblings``)."""
    if not layers:
        raise ValueError("declare_siblings: no layers given")
    for layer in layers:
        if not isinstance(layer, COLUMN_KINDS):
            raise TypeError(f"declare_siblings: {type(layer).__name__} is not a column-parallel layer (one of "
                            f"{', '.join(k.__name__ for k in COLUMN_KINDS)}): only their input gradients are partial "
                            "sums over the TP group")
    groups = {layer.group for layer in layers}
    if len(groups) > 1:
        raise ValueError(f"declare_siblings: the layers are on different TP groups ({sorted(map(str, groups))}); "
                         "a set reduces over one")
    siblings = Siblings(inputs, layers)
    for layer in layers:
        layer.siblings = siblings
    return siblings
