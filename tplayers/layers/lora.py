"""PEFT's LoRA on tensor-parallel layers: the adapter keeps PEFT's module, only its pieces are split.

A PEFT ``lora.Linear`` computes ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``. Under TP
the module stays (PEFT's forward, merging, adapter switching and saving keep working) and:

- column (output split): ``base_layer`` becomes a :class:`ColumnParallelLinear`; ``lora_B`` keeps the
  rows of this rank's output features (the base weight's placement); ``lora_A`` stays whole, its
  output ``(b, s, r)`` passes ``copy_to_tp``, so its gradient (each rank's part, from its own output
  features) is summed over the group: one all-reduce of ``b*s*r`` elements in backward. A K/V
  projection whose KV heads are replicated on several ranks (fewer KV heads than ranks): ``lora_B``
  keeps the rows of this rank's KV head, their gradient summed over the ranks sharing it, as the
  base weight's;
- row (input split): ``base_layer`` becomes a :class:`RowParallelLinear`; ``lora_A`` keeps the
  columns of this rank's input features; its partial output is summed with ``reduce_from_tp`` (one
  all-reduce of ``b*s*r`` elements in forward); ``lora_B`` stays whole.

``lora_dropout`` > 0: a column layer's input is whole and the same on every rank, and the ranks'
generators agree (``parallelize`` checks it at the first training forward), so PEFT's own dropout draws
the dense model's mask on every rank. A row layer's input is this rank's slice of the features: its
dropout (:class:`FullWidthDropout`) draws the mask for the whole width, as the dense dropout would, and
keeps this rank's columns; so training follows the dense LoRA mask for mask (bit for bit on the CPU,
whose dropout draws ``bernoulli_`` on the input's shape), at the cost of drawing ``p`` times the
random numbers for those layers. Eval: dropout is off.

DoRA (``use_dora=True``): PEFT's output is ``base + (m / n - 1) * base + (m / n) * scaling * B A x`` with
``n`` the norm of each output row of ``W + scaling * B @ A``, detached (no gradient through it, as in the
paper and PEFT). :class:`DoRAMagnitude` takes the place of PEFT's ``lora_magnitude_vector[adapter]``:

- column: a row's norm spans the unsplit input features, so it is local; the magnitude ``m`` is split
  like the output rows (KV heads on several ranks: its gradient summed over them, as ``lora_B``'s). No
  collective added;
- row: each rank holds some input columns of every row, so the squared norms are summed over the group:
  one all-reduce of ``out_features`` elements in forward, none in backward (the norm is detached). ``m``
  is replicated, and its gradient is complete on every rank (it multiplies the summed, replicated
  output), so no gradient collective either.

With ``lora_dropout`` > 0 in training PEFT computes the base term again on the dropped input: a column
layer's input gradient from it is this rank's part (one all-reduce of ``b*s*in`` in backward), a row
layer's output of it is a partial sum (one all-reduce of ``b*s*out`` in forward). In eval, or without
dropout, PEFT reuses the base layer's output and these are not needed.

Merging works on the shards as they are (``B_local @ A`` and ``B @ A_local`` have the local weight's
shape; DoRA's merge asks :meth:`DoRAMagnitude.get_weight_norm`, which sums over the group on a row
layer, so every rank merges together). Refused, naming the reason: LoRA variants other than DoRA, DoRA
over a GPT-2 ``Conv1D`` (``fan_in_fan_out``), a bias on ``lora_B``, and layers whose input or output is
not plainly split (gathered outputs, split-inside inputs, sequence parallelism). Adapters are split when
``parallelize`` runs: add them before it, not after.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.blocking import all_reduce_tensor
from ..core.comm import copy_to_tp, reduce_from_tp
from ..core.groups import GroupLike, resolve_group
from ..core.placement import Placement, Replicated, Sharded
from .base import TensorParallelModule
from .fused import ReplicaRun, with_replica_grads
from .linear import mask_padding

__all__ = ["is_peft_lora", "prepare_lora", "LoRAPiece", "DoRAMagnitude", "FullWidthDropout"]


def is_peft_lora(module: nn.Module) -> bool:
    """A PEFT LoRA layer (``peft.tuners.lora.Linear`` and kin): a ``base_layer`` with ``lora_A`` / ``lora_B``."""
    return (type(module).__module__.startswith("peft.") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict) and hasattr(module, "base_layer"))


_DORA = "DoraLinearVariant"  # PEFT's DoRA on a linear layer (class names: tplayers does not import peft)


def _dora_adapters(module: nn.Module) -> Tuple[str, ...]:
    return tuple(a for a, v in getattr(module, "lora_variant", {}).items() if type(v).__name__ == _DORA)


def _check_plain_lora(module: nn.Module, name: str) -> None:
    variants = {a: type(v).__name__ for a, v in getattr(module, "lora_variant", {}).items()}
    other = {a: v for a, v in variants.items() if v != _DORA}
    if other:
        raise TypeError(f"parallelize: module '{name}': LoRA variants {sorted(other)} ({', '.join(sorted(set(other.values())))}) "
                        "are not supported on TP layers: each computes its own function of the whole weight, which "
                        "nobody has split yet; use plain LoRA or DoRA (use_dora=True)")
    for adapter in _dora_adapters(module):
        magnitude = module.lora_magnitude_vector[adapter]
        if type(magnitude).__name__ != "DoraLinearLayer" or getattr(magnitude, "fan_in_fan_out", False):
            raise TypeError(f"parallelize: module '{name}': adapter '{adapter}': DoRA as {type(magnitude).__name__} "
                            f"with fan_in_fan_out={getattr(magnitude, 'fan_in_fan_out', None)} is not supported on TP "
                            "layers: only DoRA over an nn.Linear is split (a TP layer holds a GPT-2 Conv1D's weight as "
                            "nn.Linear's (out, in), which PEFT's DoRA merge would transpose)")
    if getattr(module, "merged", False):
        raise ValueError(f"parallelize: module '{name}': the LoRA adapter is merged into the base weight; "
                         "unmerge it first (or merge_and_unload() and parallelize the plain model)")
    for adapter, dropout in module.lora_dropout.items():
        if not isinstance(dropout, (nn.Identity, nn.Dropout)):
            raise TypeError(f"parallelize: module '{name}': adapter '{adapter}' has lora_dropout "
                            f"{type(dropout).__name__}; an nn.Dropout (or none) is supported")
    for adapter, lora_b in module.lora_B.items():
        if not isinstance(lora_b, nn.Linear) or lora_b.bias is not None:
            raise ValueError(f"parallelize: module '{name}': adapter '{adapter}': lora_B must be an nn.Linear "
                             "without bias (lora_bias=False)")


class LoRAPiece(TensorParallelModule):
    """This rank's piece of a LoRA factor (``lora_B`` of a column layer, ``lora_A`` of a row layer):
    ``x @ weight.T``, the weight placed like the base layer's. No communication of its own (the
    hooks :func:`prepare_lora` installs on ``lora_A`` do it)."""

    def __init__(self, weight: torch.Tensor, placement: Sharded, *, group: GroupLike,
                 replica_runs: Tuple[ReplicaRun, ...] = ()) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.placement = placement
        self.replica_runs = tuple(replica_runs)  # (start, stop, holders): local rows held by several ranks
        # a row layer's lora_A over an uneven split: this rank's real input features (the rest is padding)
        self.in_features_real = (placement.pieces(self.group.rank, self.group.size)[0].length
                                 if placement.dim == 1 and len(placement.parts) == 1 else weight.shape[1])
        self.out_features, self.in_features = weight.shape  # local
        self.weight = nn.Parameter(weight)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "LoRAPiece":
        """``dense``: the full ``nn.Linear`` factor; ``placement=``: how its weight is split;
        ``replica_runs=``: the base layer's replicated rows (KV heads shared by several ranks)."""
        tp, placement = resolve_group(group), options["placement"]
        piece = cls(placement.shard(dense.weight.detach(), tp.rank, tp.size).clone(), placement, group=tp,
                    replica_runs=options.get("replica_runs", ()))
        piece.weight.requires_grad_(dense.weight.requires_grad)
        return piece

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out), local sizes
        x = mask_padding(x, self.in_features_real, self.in_features)  # an uneven split's padding, as RowParallelLinear
        # rows of a KV head other ranks hold too: their gradient summed there, as the base layer's
        return F.linear(x, with_replica_grads(self.weight, self.replica_runs, self.group))

    def param_placements(self) -> Dict[str, Placement]:
        return {"weight": self.placement}

    def to_dense(self) -> nn.Module:
        full = self.gather_param("weight")
        dense = nn.Linear(full.shape[1], full.shape[0], bias=False, device=full.device, dtype=full.dtype)
        with torch.no_grad():
            dense.weight.copy_(full)
        return dense

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (local), tp={self.group.size}"


class DoRAMagnitude(TensorParallelModule):
    """This rank's part of PEFT's DoRA magnitude vector (``lora_magnitude_vector[adapter]``, a
    ``DoraLinearLayer``) and the DoRA term on TP shards; PEFT's ``lora.Linear`` calls it as it calls its
    own. ``kind`` "column": ``weight`` holds this rank's output rows (placed like the base weight's rows),
    each row's norm is local; "row": ``weight`` is whole, the norms' squares are summed over the group
    (see the module docstring for the collectives)."""

    def __init__(self, weight: torch.Tensor, placement: Placement, *, group: GroupLike, kind: str, dense_cls: type,
                 replica_runs: Tuple[ReplicaRun, ...] = ()) -> None:
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"DoRAMagnitude: kind must be 'column' or 'row', got {kind!r}")
        self.group = resolve_group(group)
        self.placement, self.kind, self.dense_cls = placement, kind, dense_cls
        self.replica_runs = tuple(replica_runs)  # (start, stop, holders): local rows held by several ranks
        self.weight = nn.Parameter(weight)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "DoRAMagnitude":
        """``dense``: PEFT's ``DoraLinearLayer``; ``kind=`` "column" or "row"; ``placement=``: the magnitude's
        (a column layer's output rows; ``Replicated()`` on a row layer); ``replica_runs=`` as :class:`LoRAPiece`'s."""
        tp, placement = resolve_group(group), options["placement"]
        magnitude = cls(placement.shard(dense.weight.detach(), tp.rank, tp.size).clone(), placement, group=tp,
                        kind=options["kind"], dense_cls=type(dense), replica_runs=options.get("replica_runs", ()))
        magnitude.weight.requires_grad_(dense.weight.requires_grad)
        return magnitude.train(dense.training)

    def get_weight_norm(self, weight: torch.Tensor, lora_weight: torch.Tensor, scaling: float,
                        adapter_name: Optional[str] = None) -> torch.Tensor:
        """The norm of each output row of ``weight + scaling * lora_weight`` (local tensors, PEFT's
        signature; its merge calls this too), with no gradient: PEFT detaches it. Row layer: collective."""
        with torch.no_grad():
            w = weight + scaling * lora_weight
            if self.kind == "column" or self.group.size == 1:
                return torch.linalg.norm(w, dim=1).to(w.dtype)
            # at least float32 for the sum of squares, as linalg.norm accumulates a low-precision input
            squares = w.to(torch.promote_types(w.dtype, torch.float32)).square().sum(dim=1)
            return all_reduce_tensor(squares, group=self.group).sqrt().to(w.dtype)

    def forward(self, x: torch.Tensor, *, lora_A: nn.Module, lora_B: nn.Module, scaling: float, base_layer: nn.Module,
                base_result: Optional[torch.Tensor] = None, adapter_name: str = "default") -> torch.Tensor:
        """PEFT's ``DoraLinearLayer.forward`` on this rank's pieces: what to add to the base layer's output."""
        weight = base_layer.weight.to(x.dtype)  # local: (out/p, in) column, (out, in/p) row
        with torch.no_grad():  # B_local @ A or B @ A_local: the local weight's shape (the weights, not the modules,
            lora_weight = (lora_B.weight @ lora_A.weight).to(x.dtype)  # whose hooks would communicate)
        norm = self.get_weight_norm(weight.detach(), lora_weight, scaling)
        scale = (with_replica_grads(self.weight, self.replica_runs, self.group) / norm).view(1, -1)
        lora_result = lora_B(lora_A(x))  # the lora_A hooks do LoRA's own communication
        if base_result is not None:  # the base layer's output (local rows / the summed output), less its bias
            bias = getattr(base_layer, "bias", None)
            if bias is not None:
                base_result = base_result - bias
        elif self.kind == "column":  # dropout in training: x is the dropped input, whole on every rank; the
            # gradient this rank's rows give it is a part of the dense one, summed by copy_to_tp
            weight = with_replica_grads(weight, self.replica_runs, self.group)
            base_result = F.linear(copy_to_tp(x, group=self.group), weight)
        else:  # row: x is this rank's columns of the dropped input, so its product is a partial sum
            base_result = reduce_from_tp(F.linear(x, weight), group=self.group)
        return (scale - 1) * base_result + scale * lora_result * scaling

    def param_placements(self) -> Dict[str, Placement]:
        return {"weight": self.placement}

    def to_dense(self) -> nn.Module:
        full = self.gather_param("weight")
        dense = self.dense_cls(fan_in_fan_out=False)
        dense.weight = nn.Parameter(full.clone(), requires_grad=self.weight.requires_grad)
        return dense.train(self.training)

    def extra_repr(self) -> str:
        return f"{self.kind} layer, magnitude {self.placement}, tp={self.group.size}"


class FullWidthDropout(nn.Module):
    """Dropout on this rank's slice of the features (the input of a row layer's LoRA) that draws the mask
    for the whole width, as the dense model's dropout does, and keeps this rank's columns: the mask the
    dense model would apply, sliced (the ranks' generators agree). ``p`` as ``nn.Dropout``'s."""

    def __init__(self, p: float, placement: Sharded, rank: int, size: int) -> None:
        super().__init__()
        self.p, self.full, self.rank, self.size = p, placement.full_size, rank, size
        self.features = replace(placement, dim=-1)  # the weight's input features are the activations' last dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in/p)
        if not self.training or self.p == 0:
            return x
        noise = torch.empty(*x.shape[:-1], self.full, dtype=x.dtype, device=x.device)  # (..., in): the dense shape
        noise.bernoulli_(1 - self.p).div_(1 - self.p)  # what F.dropout draws on the dense input
        return x * self.features.shard(noise, self.rank, self.size)  # this rank's columns of it

    def extra_repr(self) -> str:
        return f"p={self.p}, mask drawn over {self.full} features"


def prepare_lora(module: nn.Module, base: TensorParallelModule, kind: str, name: str) -> Callable[[], None]:
    """Check PEFT LoRA ``module`` against its new TP ``base`` (``kind`` "column" or "row"; built by the
    style, not yet in place) and return the function that puts everything in place."""
    _check_plain_lora(module, name)
    tp = base.group
    if kind == "column":
        if getattr(base, "gather_output", False) or getattr(base, "sequence_parallel", False):
            raise ValueError(f"parallelize: module '{name}': LoRA on a column layer needs its output split and its "
                             "input whole (no gather_output, no sequence parallelism)")
    elif getattr(base, "sequence_parallel", False) or not getattr(base, "input_is_parallel", True):
        raise ValueError(f"parallelize: module '{name}': LoRA on a row layer needs its input split by the layer before "
                         "(input_is_parallel=True, no sequence parallelism)")
    placement = base.param_placements()["weight"]
    runs = base.replica_runs() if kind == "column" and hasattr(base, "replica_runs") else ()
    if not isinstance(placement, Sharded) or (any(part.shards != tp.size for part in placement.parts) and not runs):
        raise ValueError(f"parallelize: module '{name}': LoRA on a layer whose weight is placed {placement} is not "
                         "supported; leave this projection out of the LoRA target_modules")
    if _dora_adapters(module) and any(part.is_uneven for part in placement.parts):
        raise ValueError(f"parallelize: module '{name}': DoRA on a layer split unevenly (heads or ffn that do not "
                         "divide the TP degree) is not supported: its padding rows' weight norm is zero; use LoRA there "
                         "or a TP degree that divides them")
    split = module.lora_B if kind == "column" else module.lora_A
    new = {a: LoRAPiece.from_dense(lin, group=tp, placement=placement, replica_runs=runs) for a, lin in split.items()}
    # DoRA's magnitude: one entry per output row, so split like the base weight's rows (column) or whole (row)
    magnitudes = {a: DoRAMagnitude.from_dense(module.lora_magnitude_vector[a], group=tp, kind=kind, replica_runs=runs,
                                              placement=placement if kind == "column" else Replicated())
                  for a in _dora_adapters(module)}
    comm = copy_to_tp if kind == "column" else reduce_from_tp

    dropouts = {a: FullWidthDropout(d.p, placement, tp.rank, tp.size) for a, d in module.lora_dropout.items()
                if kind == "row" and isinstance(d, nn.Dropout) and d.p > 0}
    for a, d in dropouts.items():
        d.train(module.lora_dropout[a].training)

    def install() -> None:
        module.base_layer = base
        for adapter, lin in new.items():
            split[adapter] = lin
        for adapter, dropout in dropouts.items():
            module.lora_dropout[adapter] = dropout
        for adapter, magnitude in magnitudes.items():
            module.lora_magnitude_vector[adapter] = magnitude
        if tp.size > 1:
            for lora_a in module.lora_A.values():  # (b, s, r): summed in backward (column) / forward (row)
                lora_a.register_forward_hook(lambda m, args, out: comm(out, group=tp))
    return install

