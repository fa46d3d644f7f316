"""TP linears that compute in their input's dtype, for Linears that cast their weight to it in forward.

nanochat's ``Linear`` (and modded-nanogpt's ``CastedLinear``) replaces autocast by hand: float32 master weights
for the optimizer, the matmul in the activations' dtype::

    def forward(self, x):
        return F.linear(x, self.weight.to(dtype=x.dtype))      # x bfloat16, weight float32

A plain TP layer swapped in would refuse the mixed dtypes. `parallelize` probes each Linear-like module it splits
(:func:`~tplayers.layers.from_dense.casts_weight_to_input`) and gives its TP layer the class here that keeps the
cast (:func:`keep_input_dtype`): its forward runs the TP layer's under ``torch.autocast`` of the input's dtype
whenever that differs from the weight's. Autocast's cast is the same ``weight.to(x.dtype)``, recorded by autograd,
so the weight gradients reach the float32 parameters as the dense model's do, and every path of the TP layers
(overlap, siblings, main_grad, the invariant tree) already knows it. Its ``to_dense()`` (and the audit's twin) is a
:class:`~tplayers.layers.from_dense.CastingLinear`. Plain TP layers never enter this module.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.nn as nn

from .fused import FusedColumnParallelLinear
from .linear import ColumnParallelLinear, RowParallelLinear
from .vocab import ParallelLMHead

__all__ = ["keep_input_dtype", "InputDtypeColumnParallelLinear", "InputDtypeRowParallelLinear",
           "InputDtypeFusedColumnParallelLinear", "InputDtypeParallelLMHead"]

_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


class _InInputDtype:
    """The TP layer's forward in its input's dtype (autocast off; under an outer autocast the dense forward
    computes in autocast's dtype too, as the layer does)."""

    cast_weight_to_input = True  # (from_dense.CAST_ATTR: to_dense gives a CastingLinear)
    weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype or not x.is_floating_point() or torch.is_autocast_enabled(x.device.type):
            return super().forward(x)  # type: ignore[misc]
        if x.dtype not in _AUTOCAST_DTYPES:
            raise TypeError(f"{type(self).__name__}: computes in its input's dtype (the Linear it replaced cast its "
                            "weight to it), which it does under torch.autocast: bfloat16 or float16 inputs; got a "
                            f"{x.dtype} input for {self.weight.dtype} weights (cast the model to one dtype)")
        with torch.autocast(x.device.type, dtype=x.dtype):
            return super().forward(x)  # type: ignore[misc]


class InputDtypeColumnParallelLinear(_InInputDtype, ColumnParallelLinear):
    """`ColumnParallelLinear` computing in its input's dtype (module docstring)."""


class InputDtypeRowParallelLinear(_InInputDtype, RowParallelLinear):
    """`RowParallelLinear` computing in its input's dtype (module docstring)."""


class InputDtypeFusedColumnParallelLinear(_InInputDtype, FusedColumnParallelLinear):
    """`FusedColumnParallelLinear` computing in its input's dtype (module docstring)."""


class InputDtypeParallelLMHead(_InInputDtype, ParallelLMHead):
    """`ParallelLMHead` computing in its input's dtype (module docstring)."""


_CLASSES: Dict[type, type] = {ColumnParallelLinear: InputDtypeColumnParallelLinear,
                              RowParallelLinear: InputDtypeRowParallelLinear,
                              FusedColumnParallelLinear: InputDtypeFusedColumnParallelLinear,
                              ParallelLMHead: InputDtypeParallelLMHead}


def keep_input_dtype(layer: nn.Module) -> Any:
    """``layer`` (a TP linear just built from a Linear whose forward cast its weight to the input's dtype) made the
    class that keeps that cast; a layer of another class is refused (it would drop it)."""
    cls = _CLASSES.get(type(layer))
    if cls is None:
        raise TypeError(f"{type(layer).__name__}: the Linear it replaces casts its weight to the input's dtype in "
                        "forward; this layer class cannot keep that (column, row, fused and LM head layers can)")
    layer.__class__ = cls
    return layer
