"""nn.Modules over the fused ops: ColumnParallelLinear and RowParallelLinear.

Both keep ``nn.Linear``'s names (``weight``, ``bias``) and initialization: built under the same
RNG state as ``nn.Linear(in_features, out_features)``, rank r holds exactly the r-th chunk of
the weight that ``nn.Linear`` would have drawn (the full matrix is drawn on every rank, then
sliced; use ``device="meta"`` plus ``from_dense`` or a checkpoint to skip that).

``delay_wgrad=True``: backward computes the input gradient only and records the weight-gradient
GEMMs in the layer's ``wgrad_store``; ``tplayers.backward_dw(model)`` runs them (gradients identical).
``tplayers.use_main_grad(model)``: the weight-gradient GEMMs accumulate into float32 ``param.main_grad``.

``split``: how the split features are cut, a :class:`~tplayers.core.placement.Part` (default: evenly,
one piece per rank). An uneven part (``Sharded.balanced(...).parts[0]``; whole heads:
:func:`~tplayers.core.head_layout.head_parts`) gives every rank the largest piece's width, a shorter
piece followed by zero features; the row-parallel layer masks those input features, so their weights
stay zero and get a zero gradient.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.comm import gather_from_tp
from ..core.functional import column_parallel_linear, row_parallel_linear
from ..core.groups import GroupLike, resolve_group
from ..core.invariant import invariant_column_linear, invariant_row_linear
from ..core.siblings import Siblings
from ..core.wgrad import ReplicatedRows, WeightGradStore
from ..core.placement import Part, Placement, Replicated, Sharded, require_positive
from .base import TensorParallelModule
from .from_dense import check_dense_linear, linear_to_dense, load_full_params, reset_linear_params

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "mask_padding", "grad_sinks", "refuse_with_invariant"]


def mask_padding(x: torch.Tensor, real: int, width: int) -> torch.Tensor:
    """``x`` (last dim: a local piece of ``width`` features, ``real`` of them real) with the features from
    ``real`` on zeroed: the padding of an uneven split, where a producer may leave anything (a padded query
    head attends to a real KV head). ``x`` itself when ``real == width`` (no padding: an even split, or an
    input that is not a piece at all); never in place (autograd may have saved ``x``)."""
    if real >= width:
        return x
    return x * (torch.arange(x.shape[-1], device=x.device) < real).to(x.dtype)  # (..., in_local)


def grad_sinks(layer: nn.Module) -> Dict[str, Any]:
    """The ``wgrad_store`` / ``main_grads`` / ``collective_matmul`` keyword arguments of a TP linear's fused op."""
    main = None
    if layer.accumulate_main_grad:
        main = (layer.weight.main_grad, None if layer.bias is None else layer.bias.main_grad)
        runs = layer.replica_runs() if getattr(layer, "has_replicas", False) else ()
        if runs:  # KV heads shared by several ranks: each step's contribution summed over them first
            main = tuple(None if buf is None else ReplicatedRows(buf, runs) for buf in main)
    return {"wgrad_store": layer.wgrad_store if layer.delay_wgrad else None, "main_grads": main,
            "collective_matmul": layer.collective_matmul}


def refuse_with_invariant(layer: nn.Module) -> None:
    """A ``tp_invariant`` layer computes its own fixed-tree path: a switch it would silently ignore is refused."""
    on = [n for n in ("delay_wgrad", "accumulate_main_grad", "collective_matmul") if getattr(layer, n, False)]
    if on:
        raise RuntimeError(f"{type(layer).__name__}: parallelize(..., tp_invariant=True) computes the fixed tree's "
                           f"own path; {', '.join(on)} is not available with it (set_overlap / use_main_grad)")


def _split_part(split: Optional[Part], features: int, tp_size: int, layer: str, what: str) -> Part:
    """The part ``features`` are cut by: ``split`` (checked against the layer), else an even split."""
    if split is None:
        require_positive(features, layer, what)
        if features % tp_size:
            raise ValueError(f"{layer}: {what}={features} is not divisible by the TP degree {tp_size}; for pieces as "
                             "even as possible pass split= (an uneven Part: Sharded.balanced(...).parts[0]), in a plan "
                             "the style Column(uneven=True) / Row(uneven=True) on both sides")
        return Part(features, tp_size)
    if not isinstance(split, Part) or split.size != features or split.shards != tp_size or split.padded:
        raise ValueError(f"{layer}: split={split!r} must be a Part of {what}={features} rows cut into one piece per "
                         f"rank (shards={tp_size}; uneven pieces by counts=, not padded=)")
    return split


class ColumnParallelLinear(TensorParallelModule):
    """``nn.Linear`` with the output features split across the TP group.

    Input ``(..., in)`` replicated (``(..., seq/p, in)`` with ``sequence_parallel``). Output
    ``(..., out/p)``, or ``(..., out)`` on every rank with ``gather_output=True``.
    Rank r holds rows ``[r*out/p, (r+1)*out/p)`` of the dense weight, and that slice of bias.
    ``siblings``: the set of column layers it is declared to share its input-gradient collective with
    (:func:`tplayers.declare_siblings`; ``parallelize`` declares each region's); None: it reduces its own.
    """

    siblings: Optional[Siblings] = None
    tp_invariant = False  # parallelize(..., tp_invariant=True): the same bits at every TP degree (core/invariant.py)

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
        delay_wgrad: bool = False,
        split: Optional[Part] = None,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.delay_wgrad, self.wgrad_store, self.accumulate_main_grad = delay_wgrad, WeightGradStore(), False
        self.collective_matmul = False  # set_overlap(model, collective_matmul=True), sequence parallel only
        require_positive(in_features, "ColumnParallelLinear", "in_features")
        self.split = _split_part(split, out_features, self.group.size, "ColumnParallelLinear", "out_features")
        self.out_features_per_rank = self.split.local_size
        if gather_output and self.split.is_uneven:
            raise ValueError("ColumnParallelLinear: gather_output=True with an uneven split would gather the zero "
                             "padding between the pieces; keep the output sharded (a row-parallel layer takes it)")
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
        reset_linear_params(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_invariant:
            refuse_with_invariant(self)
            out = invariant_column_linear(x, self.weight, self.bias, self.group, self.sequence_parallel,
                                          siblings=self.siblings)
            return gather_from_tp(out, group=self.group) if self.gather_output else out
        if self.group.size == 1 and not self.delay_wgrad and not self.accumulate_main_grad:  # nn.Linear exactly
            return F.linear(x, self.weight, self.bias)
        out = column_parallel_linear(x, self.weight, self.bias, group=self.group,
                                     sequence_parallel=self.sequence_parallel, overlap_comm=self.overlap_comm,
                                     siblings=self.siblings, **grad_sinks(self))
        return gather_from_tp(out, group=self.group) if self.gather_output else out  # (..., out) | (..., out/p)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "ColumnParallelLinear":
        """This rank's shard of an existing ``nn.Linear`` (the dense layer is left untouched)."""
        check_dense_linear(dense, cls)
        layer = cls(dense.in_features, dense.out_features, dense.bias is not None, group=group,
                    device="meta", dtype=dense.weight.dtype, **options)
        load_full_params(layer, {"weight": dense.weight, "bias": dense.bias}, like=dense)
        return layer

    def to_dense(self) -> nn.Linear:
        """The full ``nn.Linear``, gathered on every rank (collective)."""
        return linear_to_dense(self)

    def param_placements(self) -> Dict[str, Placement]:
        rows = Sharded(0, (self.split,))
        return {"weight": rows, "bias": rows} if self.bias is not None else {"weight": rows}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp_size={self.group.size}, tp_rank={self.group.rank}, "
                f"out_features_per_rank={self.out_features_per_rank}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(TensorParallelModule):
    """``nn.Linear`` with the input features split across the TP group.

    Input ``(..., in/p)`` (``input_is_parallel=True``) or ``(..., in)`` replicated. Output
    ``(..., out)`` on every rank (``(..., seq/p, out)`` with ``sequence_parallel``).
    Rank r holds columns ``[r*in/p, (r+1)*in/p)`` of the dense weight and the full bias.
    """

    tp_invariant = False  # as ColumnParallelLinear's

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
        delay_wgrad: bool = False,
        split: Optional[Part] = None,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.delay_wgrad, self.wgrad_store, self.accumulate_main_grad = delay_wgrad, WeightGradStore(), False
        self.collective_matmul = False  # set_overlap(model, collective_matmul=True), sequence parallel only
        require_positive(out_features, "RowParallelLinear", "out_features")
        self.split = _split_part(split, in_features, self.group.size, "RowParallelLinear", "in_features")
        self.in_features_per_rank = self.split.local_size
        # this rank's real input features; past them, zero padding of an uneven split
        self.in_features_real = self.split.piece(self.group.rank)[1]
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        if self.split.is_uneven and not input_is_parallel:
            raise ValueError("RowParallelLinear: an uneven split needs input_is_parallel=True (the input arrives "
                             "already cut by the same split)")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.overlap_comm = input_is_parallel, sequence_parallel, overlap_comm
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features_per_rank, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Redraw the full ``nn.Linear`` init and keep this rank's columns (and the full bias)."""
        reset_linear_params(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_invariant:  # (input split: parallelize refuses input_is_parallel=False and uneven splits here)
            refuse_with_invariant(self)
            return invariant_row_linear(x, self.weight, self.bias, self.group, self.sequence_parallel)
        if self.group.size == 1 and not self.delay_wgrad and not self.accumulate_main_grad:  # nn.Linear exactly
            return F.linear(x, self.weight, self.bias)
        if self.in_features_real < self.in_features_per_rank:  # an uneven split's padding features reach neither
            x = mask_padding(x, self.in_features_real, self.in_features_per_rank)  # the output nor the weights' grad
        return row_parallel_linear(x, self.weight, self.bias, group=self.group,  # (..., out)
                                   input_is_parallel=self.input_is_parallel,
                                   sequence_parallel=self.sequence_parallel, **grad_sinks(self))

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "RowParallelLinear":
        """This rank's shard of an existing ``nn.Linear`` (the dense layer is left untouched)."""
        check_dense_linear(dense, cls)
        layer = cls(dense.in_features, dense.out_features, dense.bias is not None, group=group,
                    device="meta", dtype=dense.weight.dtype, **options)
        load_full_params(layer, {"weight": dense.weight, "bias": dense.bias}, like=dense)
        return layer

    def to_dense(self) -> nn.Linear:
        """The full ``nn.Linear``, gathered on every rank (collective)."""
        return linear_to_dense(self)

    def param_placements(self) -> Dict[str, Placement]:
        columns = Sharded(1, (self.split,))
        return {"weight": columns, "bias": Replicated()} if self.bias is not None else {"weight": columns}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp_size={self.group.size}, tp_rank={self.group.rank}, "
                f"in_features_per_rank={self.in_features_per_rank}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")

