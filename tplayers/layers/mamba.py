"""Tensor-parallel Mamba-2 mixers: every rank holds 1/p of the heads.

A Mamba-2 mixer (Hugging Face's Granite-MoE-Hybrid, Nemotron-H, Bamba, Falcon-H1 ...) is, per token::

    in_proj (h -> [gate (d), x (d), B (G n), C (G n), dt (H)])       d = H heads x P head_dim, G groups
    causal depthwise conv1d over the channels [x, B, C], then SiLU
    SSM scan: head i reads x_i, dt_i, A_i, D_i and its group's B, C (heads H/G per group)
    gated RMSNorm of the scan output by silu(gate), over each group's d/G channels
    out_proj (d -> h)

Megatron's layout splits it by heads like an attention: rank r holds heads ``[rH/p, (r+1)H/p)`` and
everything that belongs to them (their rows of gate, x and dt in ``in_proj``, their conv channels,
``A_log`` / ``D`` / ``dt_bias``, their norm channels, their columns of ``out_proj``), so the scan runs
with no communication::

    x (b, s, h) whole          f: in_proj column-parallel (backward: the input's gradient all-reduced)
    rank r: its heads' gate, x, dt; B and C of its heads' groups    -> conv, scan, norm on its channels
    out_proj row-parallel      g: the partial outputs all-reduced (one per mixer forward)

B and C belong to groups, not heads. When G divides by p each rank holds its own groups. When p
divides by G (Granite's G = 1: one group for every head) a group's B and C are held whole by the
``p / G`` ranks whose heads read it, and each of them computes only its heads' share of their
gradient: their rows of ``in_proj`` and ``conv1d`` have their gradients summed over those ranks
(``with_replica_grads``). The gated norm of such a group spans ranks too: its sum of squares is
all-reduced (one ``(b, s, G)`` float32 tensor each way per mixer).

:class:`ParallelMamba2` is the model's own mixer class with this rank's parameters and local counts
(``num_heads``, ``intermediate_size``, ``n_groups``, ``conv_dim``), so the family's forward, its cache
handling and its kernels for the scan and the conv run unchanged on local tensors. Its fused
training kernel (``mamba_split_conv1d_scan_combined``) applies ``out_proj``'s weight itself, which
would skip the row layer's all-reduce: a sharded mixer always takes the unfused path.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.comm import copy_many_to_tp, copy_to_tp, reduce_from_tp
from ..core.groups import GroupLike, resolve_group
from ..core.placement import Placement, Replicated, Sharded
from .base import PLACEMENTS_ATTR, TensorParallelModule, class_name, mixed_class, module_copy, params_read_as
from .from_dense import load_full_params, new_param
from .fused import FusedColumnParallelLinear, ReplicaRun, with_replica_grads
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ParallelMamba2", "ParallelMamba1", "ParallelGatedRMSNorm", "ChannelParallelConv1d", "is_mamba2_mixer",
           "is_mamba1_mixer"]

# what a Mamba-2 mixer of Hugging Face's layout has (Granite-MoE-Hybrid, Nemotron-H, Bamba, Mamba2 ...)
_MIXER_ATTRS = ("in_proj", "conv1d", "out_proj", "norm", "A_log", "D", "dt_bias", "num_heads", "head_dim",
                "intermediate_size", "n_groups", "ssm_state_size", "conv_dim")
_PER_HEAD = ("A_log", "D", "dt_bias")  # (H,) parameters
_LOCAL_COUNTS = ("num_heads", "intermediate_size", "n_groups", "conv_dim", "groups_time_state_size")
# what a Mamba-1 mixer of Hugging Face's layout has (Jamba's: x_proj -> dt, B, C with their norms)
_MAMBA1_ATTRS = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj", "A_log", "D", "dt_layernorm", "b_layernorm",
                 "c_layernorm", "intermediate_size", "time_step_rank", "ssm_state_size")
_MAMBA1_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def is_mamba1_mixer(module: nn.Module) -> bool:
    """``module`` has the parts and counts of Hugging Face's Jamba Mamba-1 mixer (:data:`_MAMBA1_ATTRS`)."""
    return all(hasattr(module, a) for a in _MAMBA1_ATTRS) and isinstance(getattr(module, "conv1d"), nn.Conv1d)


def is_mamba2_mixer(module: nn.Module) -> bool:
    """``module`` has the parts and counts of Hugging Face's Mamba-2 mixers (:data:`_MIXER_ATTRS`)."""
    return all(hasattr(module, a) for a in _MIXER_ATTRS) and isinstance(getattr(module, "conv1d"), nn.Conv1d)


def _group_sum(local: torch.Tensor, slot: int, groups: int, group: Any) -> torch.Tensor:
    """``local`` (..., 1) summed over the ranks whose slot is ``slot`` of ``groups``: all-reduce forward
    (the sum) and backward (each holder's output depends on every holder's channels)."""
    slots = F.pad(local, (slot, groups - slot - 1))  # (..., G): this rank's sum in its group's slot
    return reduce_from_tp(copy_to_tp(slots, group=group), group=group)[..., slot:slot + 1]


class ChannelParallelConv1d(nn.Conv1d, TensorParallelModule):
    """A depthwise ``nn.Conv1d`` (one filter per channel) holding this rank's channels of ``placement``
    (weight ``(channels, 1, k)`` and bias cut along dim 0 alike); still an ``nn.Conv1d`` for the family's code."""

    def __init__(self, dense: nn.Conv1d, placement: Sharded, *, group: GroupLike) -> None:
        g = resolve_group(group)
        channels = placement.local_size
        super().__init__(channels, channels, dense.kernel_size, stride=dense.stride, padding=dense.padding,
                         dilation=dense.dilation, groups=channels, bias=dense.bias is not None,
                         padding_mode=dense.padding_mode, device="meta")
        self.group, self.placement = g, placement
        load_full_params(self, {"weight": dense.weight, "bias": dense.bias}, like=dense)  # (refuses copies that differ)

    def param_placements(self) -> Dict[str, Placement]:
        return {name: self.placement for name, _ in self.named_parameters(recurse=False)}

    def to_dense(self) -> nn.Conv1d:
        channels = self.placement.full_size
        dense = nn.Conv1d(channels, channels, self.kernel_size, stride=self.stride, padding=self.padding,
                          dilation=self.dilation, groups=channels, bias=self.bias is not None,
                          padding_mode=self.padding_mode, device="meta")
        for name, local in self.named_parameters(recurse=False):
            dense._parameters[name] = nn.Parameter(self.gather_param(name), requires_grad=local.requires_grad)
        return dense


class ParallelGatedRMSNorm(TensorParallelModule):
    """A Mamba-2 mixer's gated RMSNorm (``norm(y, gate)``: ``y * silu(gate)`` normalized over each group of
    ``group_size`` channels, times ``weight``) on this rank's channels. ``spans_ranks``: a group's
    channels lie on ``p / G`` ranks (G < p), so its sum of squares is all-reduced; otherwise each rank
    normalizes its own whole groups with no communication."""

    def __init__(self, dense: nn.Module, *, group: GroupLike, groups: int) -> None:
        super().__init__()
        self.group = g = resolve_group(group)
        self.groups, self.group_size, self.eps = groups, int(dense.group_size), float(dense.variance_epsilon)
        channels = dense.weight.shape[0]
        self.placement = Sharded.split(0, channels, g.size)
        self.spans_ranks = groups < g.size
        self.weight = nn.Parameter(torch.empty(self.placement.local_size, device="meta"))
        load_full_params(self, {"weight": dense.weight}, like=dense)
        empty = module_copy(dense, type(dense))  # the dense norm without its weight: to_dense fills it in
        empty._parameters = {}
        self.__dict__["_dense"] = empty  # (not a child module)

    def forward(self, hidden_states: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        dtype = hidden_states.dtype
        y = hidden_states.to(torch.float32)  # (b, s, d/p)
        if gate is not None:
            y = y * F.silu(gate.to(torch.float32))
        if self.spans_ranks:  # (b, s, d/p): part of one group
            slot = self.group.rank * self.groups // self.group.size
            variance = _group_sum(y.pow(2).sum(-1, keepdim=True), slot, self.groups, self.group) / self.group_size
            y = y * torch.rsqrt(variance + self.eps)
        else:  # (b, s, G/p, d/G): whole groups
            grouped = y.view(*y.shape[:-1], -1, self.group_size)
            grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
            y = grouped.view(y.shape)
        return self.weight * y.to(dtype)

    def param_placements(self) -> Dict[str, Placement]:
        return {"weight": self.placement}

    def to_dense(self) -> nn.Module:
        dense = module_copy(self._dense, type(self._dense))
        dense._parameters["weight"] = nn.Parameter(self.gather_param("weight"),
                                                   requires_grad=self.weight.requires_grad)
        return dense

    def extra_repr(self) -> str:
        return (f"channels={self.weight.shape[0]} of {self.placement.full_size}, groups={self.groups}, "
                f"spans_ranks={self.spans_ranks}, tp_size={self.group.size}")


def _mixer_group(cls: type, dense: nn.Module, group: GroupLike, options: Dict[str, Any], attrs: Tuple[str, ...],
                 kind: str) -> Tuple[Any, str]:
    """``from_dense``'s common checks: (the TP group, ``"Cls(Family)"`` for messages), or an error naming the parts
    of a ``kind`` mixer that ``dense`` lacks."""
    if options:
        raise TypeError(f"{cls.__name__}.from_dense: unexpected options {sorted(options)}")
    what = f"{cls.__name__}({type(dense).__name__})"
    missing = [a for a in attrs if not hasattr(dense, a)]
    if missing:
        raise ValueError(f"{what}: not a {kind} mixer of Hugging Face's layout (no {', '.join(missing)})")
    return resolve_group(group), what


class ParallelMamba2(TensorParallelModule):
    """A Hugging Face Mamba-2 mixer split by heads (see the module docstring). ``from_dense(mixer,
    group=g)``; the result is an instance of the mixer's own class as well."""

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "ParallelMamba2":
        g, what = _mixer_group(cls, dense, group, options, _MIXER_ATTRS, "Mamba-2")
        p = g.size
        heads, head_dim, d = int(dense.num_heads), int(dense.head_dim), int(dense.intermediate_size)
        groups, state = int(dense.n_groups), int(dense.ssm_state_size)
        bc = groups * state
        layout = [d, d, bc, bc, heads]  # in_proj's output: [gate, x, B, C, dt]
        conv = dense.conv1d
        if (heads * head_dim != d or dense.in_proj.out_features != sum(layout) or conv.in_channels != d + 2 * bc
                or conv.groups != conv.in_channels or dense.conv_dim != conv.in_channels):
            raise ValueError(f"{what}: in_proj {dense.in_proj.out_features}, conv1d {conv.in_channels} channels are not "
                             f"the layout [gate {d}, x {d}, B {bc}, C {bc}, dt {heads}] of {heads} heads x {head_dim}, "
                             f"{groups} groups x state {state}")
        if not (isinstance(dense.in_proj, nn.Linear) and isinstance(dense.out_proj, nn.Linear)):
            raise ValueError(f"{what}: in_proj and out_proj must be nn.Linear, got {class_name(dense.in_proj)}, "
                             f"{class_name(dense.out_proj)}")
        if heads % p:
            raise ValueError(f"{what}: {heads} heads do not divide the TP degree {p}")
        if groups % p and p % groups:
            raise ValueError(f"{what}: {groups} groups (of B and C) and the TP degree {p}: one must divide the other "
                             "(each rank's heads read whole groups)")
        gated_norm = not isinstance(dense.norm, nn.Identity)  # (Falcon-H1 without mamba_rms_norm: the gate enters the scan)
        if gated_norm and (int(getattr(dense.norm, "group_size", -1)) != d // groups
                           or not hasattr(dense.norm, "variance_epsilon")):
            raise ValueError(f"{what}: its norm {type(dense.norm).__name__} is not a gated RMSNorm over the "
                             f"{groups} groups of {d // groups} channels (group_size, variance_epsilon)")
        shards = min(groups, p)  # B's and C's pieces: every rank its own groups, or a group whole on p / G ranks
        names = ["gate", "x", "B", "C", "dt"]
        new = module_copy(dense, mixed_class(ParallelMamba2, type(dense)))
        new.group, new._dense_class = g, type(dense)
        new._dense_counts = {a: getattr(dense, a) for a in _LOCAL_COUNTS if hasattr(dense, a)}
        new._modules["in_proj"] = FusedColumnParallelLinear.from_dense(
            dense.in_proj, group=g, parts=layout, part_shards=[p, p, shards, shards, p], part_names=names,
            layer=f"{what}.in_proj")
        new._modules["out_proj"] = RowParallelLinear.from_dense(dense.out_proj, group=g)
        if gated_norm:
            new._modules["norm"] = ParallelGatedRMSNorm(dense.norm, group=g, groups=groups)
        conv_placement = Sharded.fused(0, [d, bc, bc], p, [p, shards, shards], layer=f"{what}.conv1d",
                                       names=names[1:4])
        new._modules["conv1d"] = local_conv = ChannelParallelConv1d(conv, conv_placement, group=g)
        local_channels = local_conv.in_channels
        # B's and C's rows of conv1d, held whole by p / G ranks when groups are fewer than ranks
        new._conv_runs: Tuple[ReplicaRun, ...] = () if shards == p else (
            (d // p, local_channels, (p // shards,) * shards),)
        new._head_placement = Sharded.split(0, heads, p)
        load_full_params(new, {name: dense._parameters[name] for name in _PER_HEAD}, like=dense)
        # buffers laid out like in_proj's output (Falcon-H1's mup_vector, (1, 1, projection)): this rank's parts of them
        in_parts = new._modules["in_proj"].placement.parts
        new._dense_buffers = {}
        for name, buf in dense._buffers.items():
            if buf is not None and buf.dim() >= 1 and buf.shape[-1] == sum(layout):
                new._dense_buffers[name] = buf
                new._buffers[name] = Sharded(buf.dim() - 1, in_parts).shard(buf, g.rank, p).clone()
        new.num_heads, new.intermediate_size = heads // p, d // p
        new.n_groups = groups // shards  # (G / p groups per rank, or the one group its heads read)
        new.conv_dim = local_channels
        if "groups_time_state_size" in new._dense_counts:  # (Falcon-H1's name for n_groups * state)
            new.groups_time_state_size = new.n_groups * state
        return new

    def param_placements(self) -> Dict[str, Placement]:
        return {name: self._head_placement for name in _PER_HEAD if self._parameters.get(name) is not None}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        conv = self.conv1d  # read through its replicas' gradient sum (the family reads its weight, not its forward)
        reads = [(conv, name, with_replica_grads(param, self._conv_runs, self.group))
                 for name, param in conv.named_parameters(recurse=False) if self._conv_runs]
        # transformers' fused training kernel multiplies by out_proj's weight itself (no all-reduce): the
        # family's forward takes it only when self.training, which nothing else in it reads
        training, self.training = self.training, False
        try:
            with params_read_as(reads):
                return super().forward(*args, **kwargs)
        finally:
            self.training = training

    def to_dense(self) -> nn.Module:
        """The dense mixer (collective: every rank gathers every shard)."""
        dense = module_copy(self, self._dense_class)
        for attr in ("group", "_dense_class", "_dense_counts", "_conv_runs", "_head_placement", "_dense_buffers"):
            dense.__dict__.pop(attr, None)
        dense.__dict__.update(self._dense_counts)
        dense._buffers.update(self._dense_buffers)
        for name in ("in_proj", "out_proj", "norm", "conv1d"):
            if isinstance(self._modules[name], TensorParallelModule):
                dense._modules[name] = self._modules[name].to_dense()
        for name in _PER_HEAD:
            dense._parameters[name] = nn.Parameter(self.gather_param(name),
                                                   requires_grad=self._parameters[name].requires_grad)
        return dense

    def extra_repr(self) -> str:
        d = self._dense_counts
        shared = f", each held by {self._conv_runs[0][2][0]} ranks" if self._conv_runs else ""
        return (f"heads {self.num_heads} of {d['num_heads']}, groups {self.n_groups} of {d['n_groups']}{shared}, "
                f"tp_size={self.group.size}")


class ParallelMamba1(TensorParallelModule):
    """A Hugging Face Mamba-1 mixer (Jamba's) split by channels: each of the ``d`` inner channels is its own
    state-space recurrence, so rank r holds channels ``[rd/p, (r+1)d/p)``: its rows of ``in_proj`` ([x; gate]),
    its conv channels, rows of ``dt_proj``, ``A_log`` and ``D``, and its columns of ``x_proj`` and
    ``out_proj``::

        x (b, s, h) whole      f: in_proj column-parallel (backward: the input's gradient all-reduced)
        rank r: x_r, gate_r (b, s, d/p) -> conv -> x_proj row-parallel: dt, B, C partial sums
                               all-reduced forward; backward all-reduced too (every rank's channels read them)
        dt, B, C normed (replicated norms: each rank's gradient covers its channels, summed: one all-reduce)
        rank r: dt_proj rows, scan over its channels, gate      out_proj row-parallel: g

    Forward two all-reduces per mixer (``x_proj``'s ``(b, s, R + 2N)``, ``out_proj``'s), backward three
    (``x_proj``'s output gradient, the three norms' weight gradients, ``in_proj``'s input gradient). The
    family's forward runs unchanged on local tensors; its quantized path (``dt_proj`` called as a module) is
    refused."""

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "ParallelMamba1":
        g, what = _mixer_group(cls, dense, group, options, _MAMBA1_ATTRS, "Mamba-1")
        p = g.size
        d, rank, state = int(dense.intermediate_size), int(dense.time_step_rank), int(dense.ssm_state_size)
        linears = {n: getattr(dense, n) for n in ("in_proj", "x_proj", "dt_proj", "out_proj")}
        if not all(type(m) is nn.Linear for m in linears.values()):
            raise ValueError(f"{what}: in_proj, x_proj, dt_proj and out_proj must be nn.Linear, got "
                             f"{ {n: type(m).__name__ for n, m in linears.items()} }")
        conv = dense.conv1d
        if (linears["in_proj"].out_features != 2 * d or linears["x_proj"].in_features != d
                or linears["x_proj"].out_features != rank + 2 * state or linears["dt_proj"].out_features != d
                or conv.in_channels != d or conv.groups != d or tuple(dense.A_log.shape) != (d, state)):
            raise ValueError(f"{what}: its parts are not the layout of {d} channels, time-step rank {rank}, state "
                             f"{state} (in_proj [x; gate], depthwise conv1d, x_proj -> [dt, B, C], dt_proj, A_log)")
        if d % p:
            raise ValueError(f"{what}: {d} channels do not divide the TP degree {p}")
        if hasattr(getattr(dense, "config", None), "_is_quantized"):
            raise ValueError(f"{what}: a quantized model calls dt_proj as a module, whose input gradient would be "
                             "summed twice; quantize after parallelize, or keep the mixers whole")
        new = module_copy(dense, mixed_class(ParallelMamba1, type(dense)))
        new.group, new._dense_class, new._dense_d = g, type(dense), d
        new._modules["in_proj"] = FusedColumnParallelLinear.from_dense(
            dense.in_proj, group=g, parts=[d, d], part_names=["x", "gate"], layer=f"{what}.in_proj")
        new._modules["conv1d"] = ChannelParallelConv1d(conv, Sharded.split(0, d, p), group=g)
        new._modules["x_proj"] = x_proj = RowParallelLinear.from_dense(dense.x_proj, group=g)
        # dt, B and C feed every rank's channels: their gradient (each rank's share) summed over the ranks
        x_proj.register_forward_hook(lambda m, a, out: copy_to_tp(out, group=g))
        new._modules["dt_proj"] = ColumnParallelLinear.from_dense(dense.dt_proj, group=g)
        new._modules["out_proj"] = RowParallelLinear.from_dense(dense.out_proj, group=g)
        new._channels = Sharded.split(0, d, p)
        load_full_params(new, {"A_log": dense.A_log, "D": dense.D}, like=dense)
        for name in _MAMBA1_NORMS:  # replicated, acting on replicated dt / B / C whose downstream is split
            norm = module_copy(getattr(dense, name), type(getattr(dense, name)))
            norm._parameters = {pn: new_param(pv, pv) for pn, pv in norm._parameters.items()}
            setattr(norm, PLACEMENTS_ATTR, {n: Replicated(partial_grad=True) for n, _ in norm.named_parameters()})
            new._modules[name] = norm
        new.intermediate_size = d // p
        return new

    def param_placements(self) -> Dict[str, Placement]:
        return {"A_log": self._channels, "D": self._channels}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        g = self.group
        norms = [(getattr(self, n), pn, pv) for n in _MAMBA1_NORMS
                 for pn, pv in getattr(self, n).named_parameters(recurse=False) if pv.requires_grad]
        summed = copy_many_to_tp([pv for _, _, pv in norms], group=g) if torch.is_grad_enabled() else ()
        # each rank's gradient covers its channels: summed
        with params_read_as((module, pn, value) for (module, pn, _), value in zip(norms, summed)):
            return super().forward(*args, **kwargs)

    def to_dense(self) -> nn.Module:
        """The dense mixer (collective: every rank gathers every shard)."""
        dense = module_copy(self, self._dense_class)
        for attr in ("group", "_dense_class", "_dense_d", "_channels"):
            dense.__dict__.pop(attr, None)
        dense.intermediate_size = self._dense_d
        for name in ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj"):
            dense._modules[name] = self._modules[name].to_dense()
        for name in _MAMBA1_NORMS:
            norm = module_copy(getattr(self, name), type(getattr(self, name)))
            norm.__dict__.pop(PLACEMENTS_ATTR, None)
            norm._parameters = {pn: new_param(pv, pv) for pn, pv in norm._parameters.items()}
            dense._modules[name] = norm
        for name in ("A_log", "D"):
            dense._parameters[name] = nn.Parameter(self.gather_param(name),
                                                   requires_grad=self._parameters[name].requires_grad)
        return dense

    def extra_repr(self) -> str:
        return f"channels {self.intermediate_size} of {self._dense_d}, tp_size={self.group.size}"
