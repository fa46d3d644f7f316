"""An MLP's activation on this rank's fc1 columns (gelu, or SwiGLU on the local ``[gate_r; up_r]``), as a region's
core with its backward by hand (`tplayers.regions.region.core_vjp`)."""
from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F

__all__ = ["Activation"]


class Activation:
    """The MLP's activation on this rank's fc1 columns, as a region's core (``core(h, rows)``) with its backward by
    hand (``vjp``): the ops autograd would run, so the same bits, without a backward nested in the region's (a
    Python engine call) or the concatenation of SwiGLU's two halves' gradients (written in their halves instead)."""

    def __init__(self, activation: str) -> None:
        self.activation = activation

    def __call__(self, h: torch.Tensor, rows: Any = None) -> torch.Tensor:
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)  # the local [gate_r; up_r]
            return F.silu(gate) * up
        return F.gelu(h)

    def vjp(self, h: torch.Tensor, grad_a: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(act(h), the gradient at h)`` for ``grad_a``: (..., width) and (..., width | width / 2) -> (..., width)."""
        if self.activation != "swiglu":
            return F.gelu(h), torch.ops.aten.gelu_backward(grad_a, h)
        gate, up = h.chunk(2, dim=-1)
        silu, grad_h, f = F.silu(gate), torch.empty_like(h), gate.shape[-1]
        torch.mul(grad_a, silu, out=grad_h[..., f:])  # up's
        torch.ops.aten.silu_backward.grad_input(grad_a * up, gate, grad_input=grad_h[..., :f])  # gate's
        return silu * up, grad_h
