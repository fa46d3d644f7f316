"""GPT-2's ``Conv1D`` (a linear layer whose weight is stored ``(in, out)``, the transpose of
``nn.Linear``'s) as a tensor-parallel layer: built from one, and converting back to one.

Parameters keep ``nn.Linear`` orientation locally; ``dense_transposed = True`` tells dense export
(safetensors) to transpose the weight back to the ``(in, out)`` the original model stores.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..core.groups import GroupLike
from .fused import FusedColumnParallelLinear
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelConv1D", "RowParallelConv1D", "FusedColumnParallelConv1D", "is_conv1d",
           "conv1d_to_linear_weight", "linear_to_conv1d_weight", "conv1d_as_linear"]


def conv1d_to_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """GPT-2 ``Conv1D`` weight ``(in, out)`` -> ``nn.Linear`` weight ``(out, in)`` (a contiguous copy)."""
    if w.dim() != 2:
        raise ValueError(f"a Conv1D weight is 2-D, got shape {tuple(w.shape)}")
    return w.t().contiguous()


def linear_to_conv1d_weight(w: torch.Tensor) -> torch.Tensor:
    """``nn.Linear`` weight ``(out, in)`` -> GPT-2 ``Conv1D`` weight ``(in, out)`` (a contiguous copy)."""
    if w.dim() != 2:
        raise ValueError(f"a Linear weight is 2-D, got shape {tuple(w.shape)}")
    return w.t().contiguous()


def is_conv1d(module: nn.Module) -> bool:
    """A GPT-2 style ``Conv1D``: ``weight`` of shape ``(nx, nf)``, i.e. ``nn.Linear``'s transposed."""
    return (type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")
            and tuple(module.weight.shape) == (module.nx, module.nf))


def conv1d_as_linear(conv: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` with the same function as a ``Conv1D`` (weight transposed into a copy)."""
    lin = nn.Linear(conv.nx, conv.nf, bias=conv.bias is not None, device="meta")
    lin.weight = nn.Parameter(conv1d_to_linear_weight(conv.weight.detach()), requires_grad=conv.weight.requires_grad)
    if conv.bias is not None:
        lin.bias = nn.Parameter(conv.bias.detach(), requires_grad=conv.bias.requires_grad)
    return lin


class _Conv1DDense:
    """Mixin: this TP layer was built from a ``Conv1D``; ``to_dense()`` gives one back.

    Parameters keep ``nn.Linear`` orientation locally (``dense_transposed`` tells checkpoint
    export to transpose the weight back to the ``(in, out)`` the original model stores).
    """

    dense_transposed = True
    conv1d_cls: type

    def to_dense(self) -> nn.Module:
        lin = super().to_dense()  # type: ignore[misc]
        with torch.device("meta"):
            conv = self.conv1d_cls(lin.out_features, lin.in_features)
        conv.weight = nn.Parameter(linear_to_conv1d_weight(lin.weight.detach()), requires_grad=lin.weight.requires_grad)
        conv.bias = nn.Parameter(lin.bias.detach(), requires_grad=lin.bias.requires_grad)
        return conv

    @classmethod
    def from_conv1d(cls, conv: nn.Module, *, group: GroupLike, **options: Any) -> Any:
        layer = cls.from_dense(conv1d_as_linear(conv), group=group, **options)  # type: ignore[attr-defined]
        layer.conv1d_cls = type(conv)
        return layer


class ColumnParallelConv1D(_Conv1DDense, ColumnParallelLinear):
    """ColumnParallelLinear built from (and converting back to) a GPT-2 ``Conv1D``."""


class RowParallelConv1D(_Conv1DDense, RowParallelLinear):
    """RowParallelLinear built from (and converting back to) a GPT-2 ``Conv1D``."""


class FusedColumnParallelConv1D(_Conv1DDense, FusedColumnParallelLinear):
    """:class:`~tplayers.layers.fused.FusedColumnParallelLinear` built from (and converting back to) a
    GPT-2 ``Conv1D`` (``c_attn``: q, k, v fused, each split by heads)."""
