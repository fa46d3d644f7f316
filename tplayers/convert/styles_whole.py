"""Styles that convert a whole module of a model family's own class: MoE experts (3-D parameters), multi-head
latent attention's KV projection, Mamba mixers. The contract is :mod:`tplayers.convert.styles`'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple, Union

import torch
import torch.nn as nn

from ..core.comm import copy_to_tp
from ..layers.base import class_name
from ..layers.expert_layout import ExpertSplit
from ..layers.experts import ParallelExperts
from ..layers.mamba import ParallelMamba1, ParallelMamba2, is_mamba1_mixer, is_mamba2_mixer
from .styles import BuildContext, Built, refuse_own_forward, read_count, switched

__all__ = ["Experts", "LatentKV", "MambaMixer"]


@dataclass(frozen=True)
class Experts:
    """MoE experts kept as one module of 3-D parameters (Hugging Face's ``gate_up_proj`` /
    ``down_proj``): every expert's ffn split across ranks, the partial outputs summed once
    (:class:`~tplayers.layers.experts.ParallelExperts`). ``splits``: ``(parameter, dim, parts)`` for
    every parameter, e.g. ``(("gate_up_proj", 1, 2), ("down_proj", 2, 1))`` for Mixtral's layout
    (``parts=2``: a packed ``[gate; up]``, each half split); ``divide_attrs``: the module's int
    attributes holding the ffn size, divided by the TP degree where present; ``dispatch`` (every
    parameter cut along dim 0, whole experts per rank): ``"all_reduce"`` (every rank runs its experts on
    every token) or ``"all_to_all"`` (each rank sends its share of the routed tokens to the experts'
    ranks and back: :mod:`tplayers.layers.token_dispatch`); ``sequence_parallel`` (``"all_to_all"``): the
    experts sit in a sequence-parallel region and each rank's tokens are its own chunk of the sequence
    (``parallelize(model, "auto", sequence_parallel=True, experts="all_to_all")``)."""

    splits: Tuple[ExpertSplit, ...]
    divide_attrs: Tuple[str, ...] = ("intermediate_dim", "intermediate_size", "expert_dim")
    identity_experts: Tuple[str, ...] = ()  # child nn.Identity experts (LongCat-Flash's zero experts)
    added_once: Tuple[str, ...] = ()  # parameters added after the down projection (gpt-oss's down_proj_bias)
    dispatch: str = "all_reduce"  # whole experts: "all_to_all" sends each rank's share of the tokens to them
    sequence_parallel: bool = False  # "all_to_all": the tokens are this rank's sequence chunk (follows the switch)

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        try:
            layer = ParallelExperts.from_dense(module, group=ctx.group, splits=self.splits,
                                               divide_attrs=self.divide_attrs, identity_experts=self.identity_experts,
                                               added_once=self.added_once, dispatch=self.dispatch,
                                               sequence_parallel=self.sequence_parallel)
        except ValueError as e:
            raise ValueError(f"parallelize: module '{ctx.name}' (style Experts): {e}") from None
        return switched(layer, ctx)


@dataclass(frozen=True)
class LatentKV:
    """Multi-head latent attention's ``kv_a_proj_with_mqa`` (DeepSeek-V2/V3): kept whole on every rank.
    Its output is ``[latent (kv_lora_rank); rotary key (rope_dim)]``: the latent feeds the column-split
    ``kv_b_proj`` (whose backward sums the latent's gradient), but the rotary key is shared by every
    head and goes straight into attention, so each rank's gradient for it covers only its own heads:
    summed over the group here (one small all-reduce per layer backward). ``rope_dim``: the count, or
    the attribute path on the attention that holds it."""

    rope_dim: Union[int, str] = "qk_rope_head_dim"

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"parallelize: module '{ctx.name}' is a {class_name(module)}; style LatentKV needs an "
                            "nn.Linear")
        refuse_own_forward(module, nn.Linear, ctx, "LatentKV")
        rope = read_count(self.rope_dim, ctx, "LatentKV", "rope_dim")
        if not 0 < rope < module.out_features:
            raise ValueError(f"parallelize: module '{ctx.name}' (LatentKV): rope_dim={rope} must be positive and below "
                             f"out_features={module.out_features}")
        tp = ctx.group

        def rotary_key_grad_summed(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            latent, rotary = out.split([out.shape[-1] - rope, rope], dim=-1)
            return torch.cat([latent, copy_to_tp(rotary, group=tp)], dim=-1)
        return Built(module, finish=lambda: module.register_forward_hook(rotary_key_grad_summed),
                     label="replicated; the rotary key's gradient summed over the group")


@dataclass(frozen=True)
class MambaMixer:
    """A Mamba mixer of Hugging Face's layout split across ranks (:mod:`tplayers.layers.mamba`): a Mamba-2 mixer by
    heads (``ParallelMamba2``: ``in_proj`` column-parallel part by part, gate, x, B, C, dt; its conv channels,
    per-head ``A_log`` / ``D`` / ``dt_bias`` and gated-norm channels cut with the heads, ``out_proj`` row-parallel),
    a Mamba-1 mixer (Jamba's) by channels (``ParallelMamba1``). ``mixers_only``: a module at the pattern that is
    neither stays as it is, its children styled by their own entries (Nemotron-H names every layer's mixer
    ``mixer``: attention, MLP, MoE or Mamba)."""

    mixers_only: bool = False

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        layer_cls = (ParallelMamba2 if is_mamba2_mixer(module) else ParallelMamba1 if is_mamba1_mixer(module)
                     else None)
        if layer_cls is None and self.mixers_only:
            return Built(module)
        try:
            layer = (layer_cls or ParallelMamba2).from_dense(module, group=ctx.group)  # (None: names what is missing)
        except ValueError as e:
            raise ValueError(f"parallelize: module '{ctx.name}' (style MambaMixer): {e}") from None
        return Built(layer)
