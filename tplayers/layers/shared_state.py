"""`carry_shared_state`: at every forward of a TP model, the digests of what its TP ranks must share (its
inputs, the random generators a model with dropout draws from, its replicated parameters) ride in every
checked collective's fingerprint slot (:func:`~tplayers.core.carried.carry`), so a rank that drifts
after the first step (a batch of its own from step 2, a per-rank reseed, a scaler that stepped on one rank
only) is caught at the step where it begins, on every rank, naming what differs.

Before / now: the inputs were compared every 1000 forwards and the generators once, each with a
collective of its own; replicated parameters only when the user called ``check_replicas``. Now each forward
digests them where they live (no synchronization, no extra collective) and the collectives the model issues
anyway carry the digests.
"""
from __future__ import annotations

import sys
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..core.digest import digests, generators_digest, joint_digest
from ..core.dtensors import is_dtensor
from ..core.carried import Shared, carry, kind_of
from ..core.fingerprint import checks_enabled
from ..core.groups import GroupLike, TPGroup, resolve_group
from .base import model_placements
from .same_inputs import SequenceShardInputs, has_dropout, in_pipeline_shape_inference, named_arguments

__all__ = ["carry_shared_state"]

INPUTS_ADVICE = ("Every TP rank must see the same batch (a distributed sampler over the TP ranks splits it; in "
                 "Lightning pass use_distributed_sampler=False when data_parallel_size=1; call set_epoch alike on every "
                 "rank).")
GENERATORS_ADVICE = ("Seed every rank of a TP group alike (torch.manual_seed(seed), not seed + rank; with data "
                     "parallelism, seed + dp_rank) and draw the same random numbers on each; "
                     "parallelize(..., check_consistency=False) skips this check.")
REPLICAS_ADVICE = ("A replicated parameter must stay bitwise equal on every TP rank: step every rank alike (a loss "
                   "scaler must skip on all of them together: torch's ShardedGradScaler(process_group=<TP group>), "
                   "docs/gpu.md), and load or edit parameters alike on every rank.")


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if is_dtensor(p) else p  # (FSDP2's DTensor: this rank's rows, no communication)


def carry_shared_state(model: nn.Module, *, group: GroupLike, inputs: bool = True, generators: bool = True,
                       replicas: bool = True, sequence_shards: Optional[SequenceShardInputs] = None) -> RemovableHandle:
    """At every forward of ``model``, digest what its TP ranks must share and carry it in every checked
    collective of the group while the forward runs (the forward's own collectives, those of a loss computed
    inside it, and the first-step audit's):

    - ``inputs``: every tensor of the arguments, as :func:`~tplayers.layers.same_inputs.check_same_inputs`
      reads them;
    - ``generators``: the default CPU / CUDA generators' states, in training forwards of a model that draws
      random numbers (:func:`~tplayers.layers.same_inputs.has_dropout`, or seen moving them in an earlier
      forward: any ``torch.rand*`` outside a TP region's own generator);
    - ``replicas``: the parameters every rank holds whole.

    A rank that differs makes the collective raise :class:`~tplayers.RanksDiverged` on every rank, naming
    the argument, generator or parameter.

    Cost per forward: the inputs and the replicated parameters read once on their device (a few kernels:
    small parameters are read in one concatenation), no synchronization, no collective;
    ``CARRIED`` (4) more elements per rank in each checked collective. ``sequence_shards``: the arguments
    fed as sequence shards by design are left out of the inputs. Off with
    ``tplayers.set_collective_checks(False)`` (no slot, nothing computed). ``parallelize`` registers it
    (``check_inputs=0`` leaves the inputs out, ``check_consistency=False`` the generators and parameters).
    Returns the pre-hook's handle."""
    carrier = _Carrier(model, resolve_group(group), inputs, generators, replicas, sequence_shards)
    model.register_forward_hook(carrier.post_forward, always_call=True)
    return model.register_forward_pre_hook(carrier.pre_forward, with_kwargs=True)


class _Carrier:
    """:func:`carry_shared_state`'s hooks on one model: what each forward carries, and the error path's detail."""

    def __init__(self, model: nn.Module, tp: TPGroup, inputs: bool, generators: bool, replicas: bool,
                 sequence_shards: Optional[SequenceShardInputs]) -> None:
        self.model, self.tp, self.label = model, tp, type(model).__name__
        self.inputs, self.generators, self.replicas, self.sequence_shards = inputs, generators, replicas, sequence_shards
        self.draws = generators and has_dropout(model)  # by its config, or seen at a forward that moved the generators
        self.before: Optional[Any] = None  # the generators' digest at this forward's start (training forwards)
        self.keys = tuple((id(model), kind) for kind in ("inputs", "generators", "replicas"))
        self.calls = 0
        self.slots: List[Tuple[nn.Module, str]] = []  # where each replicated parameter sits, found at the first forward
        self.views: List[Any] = []  # their flat integer views, kept between forwards (core/digest.joint_digest)

    def replicated_params(self) -> List[Tuple[str, torch.Tensor]]:
        placements = model_placements(self.model)
        return [(name, p) for name, p in self.model.named_parameters()
                if placements.get(name) is None or not placements[name].is_sharded]

    def replicated_now(self) -> List[torch.Tensor]:  # read where they sit: a parameter replaced later is read anew
        if not self.slots:
            owners = {id(p): (m, a) for m in self.model.modules() for a, p in m.named_parameters(recurse=False)}
            self.slots.extend(owners[id(p)] for _, p in self.replicated_params() if id(p) in owners)
        return [_local(m._parameters[a]) for m, a in self.slots if m._parameters.get(a) is not None]

    def detail(self) -> List[Tuple[str, int]]:  # the error path: one digest per parameter, to name the one that differs
        params = self.replicated_params()
        return list(zip((f"'{n}'" for n, _ in params), digests([_local(t) for _, t in params]).tolist()))

    def pre_forward(self, module: nn.Module, args: Tuple[Any, ...], kwargs: dict) -> None:
        if module is not self.model or self.tp.size == 1 or not checks_enabled() or torch.compiler.is_compiling():
            return  # (a copy of the model made with its hooks, as the audit's float32 copy, carries nothing)
        pg = self.tp.process_group
        if "torch.distributed.pipelining" in sys.modules and in_pipeline_shape_inference():
            carry(pg, self.keys[0], None)  # a PipelineStage's shape inference runs on uninitialized inputs
            return
        self.calls += 1
        if self.inputs:
            self._carry_inputs(args, kwargs)
        training = self.generators and module.training and torch.is_grad_enabled()
        self.before = generators_digest() if training else None
        if self.draws and self.before is not None:
            carry(pg, self.keys[1], Shared(f"the random generators of {self.label} (it draws random numbers: dropout, "
                                           "router noise, torch.rand*)",
                                           ["CPU generator", "CUDA generator"][:len(self.before)], self.before,
                                           GENERATORS_ADVICE))
        else:
            carry(pg, self.keys[1], None)  # an evaluation or no_grad forward draws nothing
        if self.replicas:
            params = self.replicated_now()
            if params:
                carry(pg, self.keys[2], Shared(f"the replicated parameters of {self.label}", ["replicated parameters"],
                                               joint_digest(params, views=self.views), REPLICAS_ADVICE, detail=self.detail))

    def _carry_inputs(self, args: Tuple[Any, ...], kwargs: dict) -> None:
        named = named_arguments(args, kwargs)
        if self.sequence_shards is not None:
            skipped = self.sequence_shards.skipped()
            named = [(n, t) for n, t in named if n not in skipped]
        tensors = [t for _, t in named]
        carry(self.tp.process_group, self.keys[0],
              Shared(f"the inputs of {self.label} forward #{self.calls}", [n for n, _ in named], digests(tensors),
                     INPUTS_ADVICE, kinds=lambda: [kind_of(t) for t in tensors]) if named else None)

    def post_forward(self, module: nn.Module, *_: Any) -> None:  # (also when the forward raised: nothing stale left)
        if module is not self.model or torch.compiler.is_compiling():
            return  # (nothing was carried)
        # (host tensors, compared on the host: no kernel, nothing a GPU waits for)
        if not self.draws and self.before is not None and generators_digest().tolist() != self.before.tolist():
            self.draws = True  # it drew random numbers (torch.rand* in its forward): carried from its next forward
        self.before = None
        for key in self.keys:
            carry(self.tp.process_group, key, None)
