"""A column-parallel linear whose output is several components fused back to back.

The dense weight is ``[part_0; part_1; ...]`` along the output features (q, k, v heads; or
SwiGLU's gate and up). Each component is split across ranks on its own, so rank r holds
``[part_0 shard r; part_1 shard r; ...]`` and never a slice across components.

A component may have fewer shards than ranks (GQA with fewer KV heads than ranks): then
consecutive ranks hold the same piece (``p // shards`` each, or the part's ``holders``), and backward
sums that piece's gradient over them, so every replica carries the full gradient of the dense rows it holds.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ..core.groups import GroupLike, replica_group, resolve_group
from ..regions.partial_grads import PartialGradSum
from ..core.comm import sum_over_replicas
from ..core.functional import column_parallel_linear
from ..core.invariant import invariant_column_linear
from ..core.siblings import Siblings
from ..core.wgrad import WeightGradStore
from ..core.placement import Part, Placement, Sharded, require_positive
from .base import TensorParallelModule
from .from_dense import check_dense_linear, linear_to_dense, load_full_params, reset_linear_params
from .linear import grad_sinks, refuse_with_invariant

__all__ = ["FusedColumnParallelLinear", "ReplicaRun", "with_replica_grads"]


ReplicaRun = Tuple[int, int, Tuple[int, ...]]  # (start, stop, holders): local rows held by runs of ranks


def with_replica_grads(t: torch.Tensor, runs: Sequence[ReplicaRun], group: GroupLike) -> torch.Tensor:
    """``t`` (a view of it: no copy) whose rows in each run ``(start, stop, holders)`` of
    `FusedColumnParallelLinear.replica_runs` have their gradient summed over the ranks holding the same
    replica of them (one all-reduce per run)."""
    for lo, hi, holders in runs:
        t = sum_over_replicas(t, group=group, holders=holders, rows=(lo, hi))
    return t


class FusedColumnParallelLinear(TensorParallelModule):
    """``nn.Linear(in_features, sum(parts))`` with each component of ``parts`` split separately.

    ``part_shards[i]`` (default: the TP degree) is how many pieces component i is cut into; it
    must divide both the component and the TP degree. Output: ``(..., local_out)``, the local
    pieces concatenated in component order (``split(self.local_parts, -1)`` separates them).
    ``parts`` may also be :class:`~tplayers.core.placement.Part` objects, each saying how it is cut
    (uneven pieces: heads or an ffn that do not divide the TP degree); then ``part_shards`` is not given.
    ``siblings``: as :class:`~tplayers.layers.linear.ColumnParallelLinear`'s.
    """

    siblings: Optional[Siblings] = None
    tp_invariant = False  # as ColumnParallelLinear's (parallelize takes it with evenly split, unreplicated parts)

    def __init__(
        self,
        in_features: int,
        parts: Sequence[Union[int, Part]],
        bias: bool = True,
        *,
        group: GroupLike,
        part_shards: Optional[Sequence[int]] = None,
        part_names: Optional[Sequence[str]] = None,
        layer: str = "FusedColumnParallelLinear",
        sequence_parallel: bool = False,
        overlap_comm: bool = True,
        delay_wgrad: bool = False,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.group = tp = resolve_group(group)
        # as ColumnParallelLinear's
        self.delay_wgrad, self.wgrad_store, self.accumulate_main_grad = delay_wgrad, WeightGradStore(), False
        self.collective_matmul = False
        require_positive(in_features, layer, "in_features")
        if any(isinstance(n, Part) for n in parts):
            if part_shards is not None or not all(isinstance(n, Part) for n in parts):
                raise ValueError(f"{layer}: parts given as Part objects carry their own shards: give every part as a "
                                 "Part, and no part_shards")
            self.placement = Sharded(0, tuple(parts))
            self.placement.check_size(tp.size)
        else:
            self.placement = Sharded.fused(0, [int(n) for n in parts], tp.size, part_shards, layer=layer,
                                           names=part_names)
        parts = [part.size for part in self.placement.parts]
        self.in_features, self.parts = in_features, parts
        self.part_shards = [part.shards for part in self.placement.parts]
        self.out_features = sum(parts)
        self.local_parts = [part.local_size for part in self.placement.parts]
        self.sequence_parallel, self.overlap_comm, self.layer = sequence_parallel, overlap_comm, layer
        self.weight = nn.Parameter(torch.empty(sum(self.local_parts), in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(sum(self.local_parts), device=device, dtype=dtype)) if bias else None
        for _, _, holders in self.replica_runs():  # the replica ranks' own groups, made now (every rank builds)
            replica_group(tp, holders)
        # set by parallelize for a replicated k_proj / v_proj: their replica sums in one collective per forward
        self.replica_sum: Optional[PartialGradSum] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Redraw the full ``nn.Linear(in, sum(parts))`` init and keep this rank's pieces."""
        reset_linear_params(self)

    @property
    def has_replicas(self) -> bool:
        """Some component has fewer shards than ranks (its gradient is summed over replicas)."""
        return any(n < self.group.size for n in self.part_shards)

    def replica_runs(self) -> Tuple[ReplicaRun, ...]:
        """``(start, stop, holders)`` of each run of consecutive local rows (dim 0 of the weight and
        bias) that is replicated over ranks (``holders``: how many consecutive ranks hold each replica);
        adjacent components replicated alike (k and v) form one run."""
        runs: List[List[Any]] = []
        start = 0
        for local, part in zip(self.local_parts, self.placement.parts):
            holders = part.holder_counts(self.group.size)
            if max(holders) > 1:
                if runs and runs[-1][1] == start and runs[-1][2] == holders:
                    runs[-1][1] = start + local
                else:
                    runs.append([start, start + local, holders])
            start += local
        return tuple((lo, hi, h) for lo, hi, h in runs)

    def _with_replica_grads(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a view of it: no copy) whose replicated components' gradients are summed over
        their replica ranks (one all-reduce per run of `replica_runs`)."""
        return with_replica_grads(t, self.replica_runs(), self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_invariant:
            refuse_with_invariant(self)
            return invariant_column_linear(x, self.weight, self.bias, self.group, self.sequence_parallel,
                                           parts=self.local_parts, siblings=self.siblings)  # (..., [seq,] local_out)
        if self.replica_sum is not None and not (self.delay_wgrad or self.accumulate_main_grad):
            read = self.replica_sum.read  # (weight gradients into .grad now; the other sinks sum their own way)
        else:
            read = self._with_replica_grads
        weight = read(self.weight)
        bias = None if self.bias is None else read(self.bias)
        return column_parallel_linear(x, weight, bias, group=self.group, sequence_parallel=self.sequence_parallel,
                                      overlap_comm=self.overlap_comm, siblings=self.siblings,
                                      **grad_sinks(self))  # (..., [seq,] local_out)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, parts: Sequence[Any] = (),
                   **options: Any) -> "FusedColumnParallelLinear":
        """This rank's pieces of an ``nn.Linear`` whose output is ``parts`` fused back to back."""
        check_dense_linear(dense, cls)
        sizes = [n.size if isinstance(n, Part) else int(n) for n in parts]
        if sum(sizes) != dense.out_features:
            raise ValueError(f"{cls.__name__}.from_dense: parts {sizes} sum to {sum(sizes)}, "
                             f"the linear has out_features={dense.out_features}")
        layer = cls(dense.in_features, parts, dense.bias is not None, group=group, device="meta",
                    dtype=dense.weight.dtype, **options)
        load_full_params(layer, {"weight": dense.weight, "bias": dense.bias}, like=dense)
        return layer

    def to_dense(self) -> nn.Linear:
        """The full fused ``nn.Linear``, gathered on every rank (collective)."""
        return linear_to_dense(self)

    def param_placements(self) -> Dict[str, Placement]:
        return {"weight": self.placement, "bias": self.placement} if self.bias is not None else {"weight": self.placement}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, parts={self.parts}, part_shards={self.part_shards}, "
                f"bias={self.bias is not None}, tp_size={self.group.size}, tp_rank={self.group.rank}, "
                f"sequence_parallel={self.sequence_parallel}")
