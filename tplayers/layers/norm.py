"""LayerNorm / RMSNorm for transformer blocks, aware of sequence parallelism.

The norm's weights are replicated. Without sequence parallelism its input is replicated too,
so every rank computes the same full gradient. With sequence parallelism each rank normalizes
only its sequence shard, so its weight gradient is partial: the weights enter the computation
through `copy_to_tp` (identity forward, all-reduce of the gradient backward), and every rank
ends up with the full gradient, with no hook and no optimizer-side step to remember.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.comm import copy_to_tp
from ..core.groups import GroupLike, resolve_group
from ..core.placement import Placement, Replicated, require_positive
from .base import TensorParallelModule, class_name

__all__ = ["ParallelNorm", "make_norm", "NORMS"]

NORMS = ("layernorm", "rmsnorm")


def make_norm(kind: str, hidden: int, eps: float, bias: bool, device: Any = None, dtype: Any = None) -> nn.Module:
    """``nn.LayerNorm`` or ``nn.RMSNorm`` (elementwise affine; LayerNorm bias iff ``bias``)."""
    if kind not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")
    if kind == "layernorm":
        return nn.LayerNorm(hidden, eps=eps, bias=bias, device=device, dtype=dtype)
    return nn.RMSNorm(hidden, eps=eps, device=device, dtype=dtype)


def _copy_params(src: nn.Module, dst: nn.Module) -> None:
    """``dst.weight``/``dst.bias`` := ``src``'s values, ``requires_grad`` included (frozen stays frozen)."""
    for name in ("weight", "bias"):
        d = getattr(dst, name, None)  # nn.RMSNorm has no bias attribute at all
        if d is not None:
            s = getattr(src, name)
            with torch.no_grad():
                d.copy_(s)
            d.requires_grad_(s.requires_grad)


class ParallelNorm(TensorParallelModule):
    """``nn.LayerNorm`` (``kind="layernorm"``) or ``nn.RMSNorm`` (``kind="rmsnorm"``) over the
    last dim, replicated across the TP group; see the module docstring for sequence parallelism.
    ``eps=None`` (RMSNorm only) is ``nn.RMSNorm``'s default: the input dtype's machine epsilon."""

    def __init__(self, hidden: int, kind: str = "layernorm", eps: Optional[float] = 1e-5, bias: bool = True, *,
                 group: GroupLike, sequence_parallel: bool = False, device: Any = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        if kind not in NORMS:
            raise ValueError(f"ParallelNorm: kind must be one of {NORMS}, got {kind!r}")
        if eps is None and kind != "rmsnorm":
            raise ValueError("ParallelNorm: eps=None (the input dtype's epsilon) exists only for kind='rmsnorm'")
        require_positive(hidden, "ParallelNorm", "hidden")
        self.group = resolve_group(group)
        self.hidden, self.kind, self.eps, self.sequence_parallel = hidden, kind, eps, sequence_parallel
        self.weight = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))
        has_bias = bias and kind == "layernorm"
        self.bias = nn.Parameter(torch.zeros(hidden, device=device, dtype=dtype)) if has_bias else None

    def _shared(self, p: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if p is None or not self.sequence_parallel:
            return p
        return copy_to_tp(p, group=self.group)  # backward: gradient summed over the sequence shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden:
            raise ValueError(f"ParallelNorm: input's last dim is {x.shape[-1]} (shape {tuple(x.shape)}), "
                             f"expected {self.hidden}")
        return self.normalize(x, self._shared(self.weight), self._shared(self.bias))

    def normalize(self, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The norm itself with the given parameters, no communication (an interleaved block sums the
        parameters' gradients over the sequence shards itself)."""
        if self.kind == "layernorm":
            return F.layer_norm(x, (self.hidden,), weight, bias, self.eps)
        return F.rms_norm(x, (self.hidden,), weight, self.eps)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "ParallelNorm":
        if isinstance(dense, nn.LayerNorm):
            kind, bias = "layernorm", dense.bias is not None
        elif isinstance(dense, nn.RMSNorm):
            kind, bias = "rmsnorm", False
        else:
            raise TypeError(f"ParallelNorm.from_dense expects nn.LayerNorm or nn.RMSNorm, got {class_name(dense)}")
        shape = tuple(dense.normalized_shape)
        if len(shape) != 1 or dense.weight is None:
            raise ValueError(f"ParallelNorm.from_dense: only an affine norm over the last dim is supported, "
                             f"got normalized_shape={shape}, elementwise_affine={dense.weight is not None}")
        layer = cls(shape[0], kind, dense.eps, bias, group=group, device=dense.weight.device,
                    dtype=dense.weight.dtype, **options)
        _copy_params(dense, layer)
        return layer

    def to_dense(self) -> nn.Module:
        """The plain norm module with these weights (every rank holds them already)."""
        dense = make_norm(self.kind, self.hidden, self.eps, self.bias is not None, self.weight.device, self.weight.dtype)
        _copy_params(self, dense)
        return dense

    def param_placements(self) -> Dict[str, Placement]:
        # under sequence parallelism each rank normalizes its own tokens: partial gradients, summed
        placement = Replicated(partial_grad=self.sequence_parallel and self.group.size > 1)
        return {name: placement for name, _ in self.named_parameters(recurse=False)}

    def extra_repr(self) -> str:
        return (f"{self.hidden}, kind={self.kind}, eps={self.eps}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")
