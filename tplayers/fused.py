"""A column-parallel linear whose output is several components fused back to back.

The dense weight is ``[part_0; part_1; ...]`` along the output features (q, k, v heads; or
SwiGLU's gate and up). Each component is split across ranks on its own, so rank r holds
``[part_0 shard r; part_1 shard r; ...]`` and never a slice across components.

A component may have fewer shards than ranks (GQA with fewer KV heads than ranks): then
``p // num_shards`` consecutive ranks hold the same piece, and backward sums that piece's
gradient over them, so every replica carries the full gradient of the dense rows it holds.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .comm import all_gather_tensor, sum_over_replicas
from .functional import column_parallel_linear
from .groups import GroupLike, resolve_group
from .layers import ShardLayout, TensorParallelModule, _dense_linear_init, _param

__all__ = ["FusedColumnParallelLinear"]


class FusedColumnParallelLinear(TensorParallelModule):
    """``nn.Linear(in_features, sum(parts))`` with each component of ``parts`` split separately.

    ``part_shards[i]`` (default: the TP degree) is how many pieces component i is cut into; it
    must divide both the component and the TP degree. Output: ``(..., local_out)``, the local
    pieces concatenated in component order (``split(self.local_parts, -1)`` separates them).
    """

    def __init__(
        self,
        in_features: int,
        parts: Sequence[int],
        bias: bool = True,
        *,
        group: GroupLike,
        part_shards: Optional[Sequence[int]] = None,
        part_names: Optional[Sequence[str]] = None,
        layer: str = "FusedColumnParallelLinear",
        sequence_parallel: bool = False,
        overlap_comm: bool = True,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.tp = tp = resolve_group(group)
        parts = [int(n) for n in parts]
        shards = [tp.size] * len(parts) if part_shards is None else [int(n) for n in part_shards]
        names = list(part_names) if part_names is not None else [f"part {i}" for i in range(len(parts))]
        if not parts or len(shards) != len(parts) or len(names) != len(parts):
            raise ValueError(f"{layer}: parts={parts}, part_shards={shards} and part_names={names} must be "
                             "non-empty and of equal length")
        for size, n, name in zip(parts, shards, names):
            if n < 1 or tp.size % n or size % n:
                raise ValueError(f"{layer}: {name} of size {size} cannot be cut into {n} shards at TP degree "
                                 f"{tp.size} (the shard count must divide both)")
        self.in_features, self.parts, self.part_shards = in_features, parts, shards
        self.out_features = sum(parts)
        self.local_parts = [size // n for size, n in zip(parts, shards)]
        self.sequence_parallel, self.overlap_comm, self.layer = sequence_parallel, overlap_comm, layer
        self.weight = nn.Parameter(torch.empty(sum(self.local_parts), in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(sum(self.local_parts), device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    @property
    def layout(self) -> ShardLayout:
        return ShardLayout(0, tuple(zip(self.parts, self.part_shards)))

    def reset_parameters(self) -> None:
        """Redraw the full ``nn.Linear(in, sum(parts))`` init and keep this rank's pieces."""
        w, b = _dense_linear_init(self.in_features, self.out_features, self.bias is not None,
                                  self.weight.device, self.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(self.layout.shard(w, self.tp.rank, self.tp.size))
            if self.bias is not None:
                self.bias.copy_(self.layout.shard(b, self.tp.rank, self.tp.size))

    def _with_replica_grads(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a view of it: no copy) whose replicated components' gradients are summed over
        their replica ranks; adjacent components with the same shard count (k and v) share one
        all-reduce."""
        runs = []  # [start, stop, num_shards] of consecutive replicated rows
        start = 0
        for local, n in zip(self.local_parts, self.part_shards):
            if n < self.tp.size:
                if runs and runs[-1][1] == start and runs[-1][2] == n:
                    runs[-1][1] = start + local
                else:
                    runs.append([start, start + local, n])
            start += local
        for lo, hi, n in runs:
            t = sum_over_replicas(t, group=self.tp, num_shards=n, rows=(lo, hi))
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._with_replica_grads(self.weight)
        bias = None if self.bias is None else self._with_replica_grads(self.bias)
        return column_parallel_linear(x, weight, bias, group=self.tp, sequence_parallel=self.sequence_parallel,
                                      overlap_comm=self.overlap_comm)  # (..., [seq,] local_out)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, parts: Sequence[int] = (),
                   **options: Any) -> "FusedColumnParallelLinear":
        """This rank's pieces of an ``nn.Linear`` whose output is ``parts`` fused back to back."""
        if not isinstance(dense, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_dense expects an nn.Linear, got {type(dense).__name__}")
        if sum(parts) != dense.out_features:
            raise ValueError(f"{cls.__name__}.from_dense: parts {list(parts)} sum to {sum(parts)}, "
                             f"the linear has out_features={dense.out_features}")
        tp = resolve_group(group)
        layer = cls(dense.in_features, parts, dense.bias is not None, group=tp, device="meta",
                    dtype=dense.weight.dtype, **options)
        layer.weight = _param(layer.layout.shard(dense.weight, tp.rank, tp.size), dense.weight)
        if dense.bias is not None:
            layer.bias = _param(layer.layout.shard(dense.bias, tp.rank, tp.size), dense.bias)
        return layer

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        locals_: List[torch.Tensor] = list(all_gather_tensor(t, 0, group=self.tp).chunk(self.tp.size, dim=0))
        return self.layout.unshard(locals_)

    def to_dense(self) -> nn.Linear:
        """The full fused ``nn.Linear``, gathered on every rank (collective)."""
        dense = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        dense.weight = _param(self._gather(self.weight), self.weight)
        if self.bias is not None:
            dense.bias = _param(self._gather(self.bias), self.bias)
        return dense

    def param_layouts(self) -> Dict[str, ShardLayout]:
        layouts = {"weight": self.layout}
        if self.bias is not None:
            layouts["bias"] = self.layout
        return layouts

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, parts={self.parts}, part_shards={self.part_shards}, "
                f"bias={self.bias is not None}, tp_size={self.tp.size}, tp_rank={self.tp.rank}, "
                f"sequence_parallel={self.sequence_parallel}")
