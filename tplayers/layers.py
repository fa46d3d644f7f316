"""nn.Modules over the fused ops: ColumnParallelLinear and RowParallelLinear.

Both keep ``nn.Linear``'s names (``weight``, ``bias``) and initialization: built under the same
RNG state as ``nn.Linear(in_features, out_features)``, rank r holds exactly the r-th chunk of
the weight that ``nn.Linear`` would have drawn (the full matrix is drawn on every rank, then
sliced; use ``device="meta"`` plus ``from_dense`` or a checkpoint to skip that).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .comm import all_gather_tensor, gather_from_tp
from .functional import column_parallel_linear, row_parallel_linear
from .groups import GroupLike, TPGroup, resolve_group

__all__ = ["TensorParallelModule", "ColumnParallelLinear", "RowParallelLinear", "ShardLayout", "require_divisible"]


def require_divisible(size: int, tp: TPGroup, layer: str, what: str) -> int:
    """``size // tp.size``, or a ValueError naming the size, the TP degree and the layer."""
    if size % tp.size != 0:
        raise ValueError(f"{layer}: {what}={size} is not divisible by the TP degree {tp.size}")
    return size // tp.size


@dataclass(frozen=True)
class ShardLayout:
    """How one parameter's full (dense) tensor maps to each rank's local tensor.

    ``dim=None``: replicated, every rank holds the full tensor. Otherwise the full tensor is the
    concatenation along ``dim`` of ``parts``, each ``(full_size, num_shards)``: a fused weight
    (q, k, v or gate, up) has one part per component, so a shard is never a slice across
    components. Part i is cut into ``num_shards`` torch.chunk pieces and rank r holds piece
    ``r // (tp_size // num_shards)`` of every part, concatenated; ``num_shards < tp_size`` means
    consecutive ranks hold replicas of the same piece (GQA with fewer KV heads than ranks).
    """

    dim: Optional[int]
    parts: Tuple[Tuple[int, int], ...] = ()

    @staticmethod
    def replicated() -> "ShardLayout":
        return ShardLayout(None)

    @staticmethod
    def split(dim: int, full_size: int, tp_size: int) -> "ShardLayout":
        return ShardLayout(dim, ((full_size, tp_size),))

    def shard(self, full: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
        """This rank's local tensor cut from the full one (pure; no communication)."""
        if self.dim is None:
            return full
        sizes = [size for size, _ in self.parts]
        if full.shape[self.dim] != sum(sizes):
            raise ValueError(f"expected size {sum(sizes)} along dim {self.dim}, got {tuple(full.shape)}")
        pieces = []
        for part, (size, n) in zip(full.split(sizes, dim=self.dim), self.parts):
            if tp_size % n or size % n:
                raise ValueError(f"part of size {size} in {n} shards does not fit TP degree {tp_size}")
            pieces.append(part.chunk(n, dim=self.dim)[rank // (tp_size // n)])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def unshard(self, locals_: List[torch.Tensor]) -> torch.Tensor:
        """The full tensor rebuilt from every rank's local tensor, in rank order (pure)."""
        tp_size = len(locals_)
        if self.dim is None:
            return locals_[0]
        for size, n in self.parts:
            if n > tp_size or tp_size % n:
                raise ValueError(f"{tp_size} ranks' local tensors cannot hold a part cut into {n} shards")
        local_sizes = [size // n for size, n in self.parts]
        for r, t in enumerate(locals_):
            if t.shape[self.dim] != sum(local_sizes):
                raise ValueError(f"rank {r}'s local tensor has size {t.shape[self.dim]} along dim {self.dim}, "
                                 f"the layout expects {sum(local_sizes)}")
        split_locals = [t.split(local_sizes, dim=self.dim) for t in locals_]
        parts = []
        for i, (_, n) in enumerate(self.parts):
            stride = tp_size // n
            parts.append(torch.cat([split_locals[j * stride][i] for j in range(n)], dim=self.dim))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


class TensorParallelModule(nn.Module):
    """Base of every tplayers module: it knows its TP group and converts to and from dense.

    ``to_dense()`` is collective (every rank of the group must call it) and returns a plain
    ``torch.nn`` module computing the same function, on every rank.
    """

    tp: TPGroup

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "TensorParallelModule":
        raise NotImplementedError

    def to_dense(self) -> nn.Module:
        raise NotImplementedError

    def param_layouts(self) -> Dict[str, ShardLayout]:
        """Each direct parameter's :class:`ShardLayout` (checkpoints and resharding use it)."""
        raise NotImplementedError

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank


def _dense_linear_init(
    in_features: int, out_features: int, bias: bool, device: Any, dtype: Any
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The full weight and bias ``nn.Linear(in_features, out_features)`` would draw (same RNG calls)."""
    weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
    b = torch.empty(out_features, device=device, dtype=dtype) if bias else None
    if weight.device.type != "meta":
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if b is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            nn.init.uniform_(b, -bound, bound)
    return weight, b


def _check_dense_linear(linear: nn.Module, cls: type) -> None:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{cls.__name__}.from_dense expects an nn.Linear, got {type(linear).__name__}")


def _param(t: torch.Tensor, like: Optional[nn.Parameter] = None) -> nn.Parameter:
    requires_grad = True if like is None else like.requires_grad
    return nn.Parameter(t.detach().clone(), requires_grad=requires_grad)


class ColumnParallelLinear(TensorParallelModule):
    """``nn.Linear`` with the output features split across the TP group.

    Input ``(..., in)`` replicated (``(..., seq/p, in)`` with ``sequence_parallel``). Output
    ``(..., out/p)``, or ``(..., out)`` on every rank with ``gather_output=True``.
    Rank r holds rows ``[r*out/p, (r+1)*out/p)`` of the dense weight, and that slice of bias.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: GroupLike,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        overlap_comm: bool = True,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.tp = resolve_group(group)
        self.out_features_per_rank = require_divisible(out_features, self.tp, "ColumnParallelLinear", "out_features")
        if gather_output and sequence_parallel:
            raise ValueError(
                "ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel=True "
                "(the output would be gathered on the hidden dim while the sequence stays gathered)"
            )
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel, self.overlap_comm = gather_output, sequence_parallel, overlap_comm
        self.weight = nn.Parameter(torch.empty(self.out_features_per_rank, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.out_features_per_rank, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Redraw the full ``nn.Linear`` init and keep this rank's rows."""
        w, b = _dense_linear_init(self.in_features, self.out_features, self.bias is not None,
                                  self.weight.device, self.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(self.tp.shard(w, 0))
            if self.bias is not None:
                self.bias.copy_(self.tp.shard(b, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # a world of one is nn.Linear exactly (autocast, errors and all)
            return F.linear(x, self.weight, self.bias)
        out = column_parallel_linear(x, self.weight, self.bias, group=self.tp,
                                     sequence_parallel=self.sequence_parallel, overlap_comm=self.overlap_comm)
        return gather_from_tp(out, group=self.tp) if self.gather_output else out  # (..., out) | (..., out/p)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "ColumnParallelLinear":
        """This rank's shard of an existing ``nn.Linear`` (the dense layer is left untouched)."""
        _check_dense_linear(dense, cls)
        tp = resolve_group(group)
        layer = cls(dense.in_features, dense.out_features, dense.bias is not None, group=tp,
                    device="meta", dtype=dense.weight.dtype, **options)
        layer.weight = _param(tp.shard(dense.weight, 0, what="ColumnParallelLinear weight"), dense.weight)
        if dense.bias is not None:
            layer.bias = _param(tp.shard(dense.bias, 0), dense.bias)
        return layer

    def to_dense(self) -> nn.Linear:
        """The full ``nn.Linear``, gathered on every rank (collective)."""
        dense = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        dense.weight = _param(all_gather_tensor(self.weight, 0, group=self.tp), self.weight)
        if self.bias is not None:
            dense.bias = _param(all_gather_tensor(self.bias, 0, group=self.tp), self.bias)
        return dense

    def param_layouts(self) -> Dict[str, ShardLayout]:
        layouts = {"weight": ShardLayout.split(0, self.out_features, self.tp.size)}
        if self.bias is not None:
            layouts["bias"] = ShardLayout.split(0, self.out_features, self.tp.size)
        return layouts

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp_size={self.tp.size}, tp_rank={self.tp.rank}, "
                f"out_features_per_rank={self.out_features_per_rank}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(TensorParallelModule):
    """``nn.Linear`` with the input features split across the TP group.

    Input ``(..., in/p)`` (``input_is_parallel=True``) or ``(..., in)`` replicated. Output
    ``(..., out)`` on every rank (``(..., seq/p, out)`` with ``sequence_parallel``).
    Rank r holds columns ``[r*in/p, (r+1)*in/p)`` of the dense weight and the full bias.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: GroupLike,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        overlap_comm: bool = True,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.tp = resolve_group(group)
        self.in_features_per_rank = require_divisible(in_features, self.tp, "RowParallelLinear", "in_features")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.overlap_comm = input_is_parallel, sequence_parallel, overlap_comm
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features_per_rank, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Redraw the full ``nn.Linear`` init and keep this rank's columns (and the full bias)."""
        w, b = _dense_linear_init(self.in_features, self.out_features, self.bias is not None,
                                  self.weight.device, self.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(self.tp.shard(w, 1))
            if self.bias is not None:
                self.bias.copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # a world of one is nn.Linear exactly (autocast, errors and all)
            return F.linear(x, self.weight, self.bias)
        return row_parallel_linear(x, self.weight, self.bias, group=self.tp,  # (..., out)
                                   input_is_parallel=self.input_is_parallel,
                                   sequence_parallel=self.sequence_parallel, overlap_comm=self.overlap_comm)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "RowParallelLinear":
        """This rank's shard of an existing ``nn.Linear`` (the dense layer is left untouched)."""
        _check_dense_linear(dense, cls)
        tp = resolve_group(group)
        layer = cls(dense.in_features, dense.out_features, dense.bias is not None, group=tp,
                    device="meta", dtype=dense.weight.dtype, **options)
        layer.weight = _param(tp.shard(dense.weight, 1, what="RowParallelLinear weight"), dense.weight)
        if dense.bias is not None:
            layer.bias = _param(dense.bias, dense.bias)
        return layer

    def to_dense(self) -> nn.Linear:
        """The full ``nn.Linear``, gathered on every rank (collective)."""
        dense = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        dense.weight = _param(all_gather_tensor(self.weight, 1, group=self.tp), self.weight)
        if self.bias is not None:
            dense.bias = _param(self.bias, self.bias)
        return dense

    def param_layouts(self) -> Dict[str, ShardLayout]:
        layouts = {"weight": ShardLayout.split(1, self.in_features, self.tp.size)}
        if self.bias is not None:
            layouts["bias"] = ShardLayout.replicated()
        return layouts

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp_size={self.tp.size}, tp_rank={self.tp.rank}, "
                f"in_features_per_rank={self.in_features_per_rank}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")
