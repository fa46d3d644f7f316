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
from ..core.carried import Shared, carry
from ..core.fingerprint import checks_enabled
from ..core.groups import GroupLike, resolve_group
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
    tp = resolve_group(group)
    pg, label = tp.process_group, type(model).__name__
    draws = [generators and has_dropout(model)]  # found by its config, or seen at a forward that moved the generators
    before: List[Any] = [None]  # the generators' digest at this forward's start (training forwards)
    keys = tuple((id(model), kind) for kind in ("inputs", "generators", "replicas"))
    calls = [0]

    def replicated_params(root: nn.Module) -> List[Tuple[str, torch.Tensor]]:
        placements = model_placements(root)
        return [(name, p) for name, p in root.named_parameters()
                if placements.get(name) is None or not placements[name].is_sharded]

    slots: List[Tuple[nn.Module, str]] = []  # where each replicated parameter sits, found at the first forward

    def replicated_now() -> List[torch.Tensor]:  # read where they sit: a parameter replaced later is read anew
        if not slots:
            owners = {id(p): (m, a) for m in model.modules() for a, p in m.named_parameters(recurse=False)}
            slots.extend(owners[id(p)] for _, p in replicated_params(model) if id(p) in owners)
        return [_local(m._parameters[a]) for m, a in slots if m._parameters.get(a) is not None]

    def detail() -> List[Tuple[str, int]]:  # the error path: one digest per parameter, to name the one that differs
        params = replicated_params(model)
        return list(zip((f"'{n}'" for n, _ in params), digests([_local(t) for _, t in params]).tolist()))

    def hook(module: nn.Module, args: Tuple[Any, ...], kwargs: dict) -> None:
        if module is not model or tp.size == 1 or not checks_enabled() or torch.compiler.is_compiling():
            return  # (a copy of the model made with its hooks, as the audit's float32 copy, carries nothing)
        if "torch.distributed.pipelining" in sys.modules and in_pipeline_shape_inference():
            carry(pg, keys[0], None)  # a PipelineStage's shape inference runs on uninitialized inputs
            return
        calls[0] += 1
        if inputs:
            named = named_arguments(args, kwargs)
            if sequence_shards is not None:
                skipped = sequence_shards.skipped()
                named = [(n, t) for n, t in named if n not in skipped]
            carry(pg, keys[0], Shared(f"the inputs of {label} forward #{calls[0]}", [n for n, _ in named],
                                      digests([t for _, t in named]), INPUTS_ADVICE) if named else None)
        before[0] = generators_digest() if generators and module.training and torch.is_grad_enabled() else None
        if draws[0] and before[0] is not None:
            carry(pg, keys[1], Shared(f"the random generators of {label} (it draws random numbers: dropout, "
                                      "router noise, torch.rand*)", ["CPU generator", "CUDA generator"][:len(before[0])],
                                      before[0], GENERATORS_ADVICE))
        else:
            carry(pg, keys[1], None)  # an evaluation or no_grad forward draws nothing
        if replicas:
            params = replicated_now()
            if params:
                carry(pg, keys[2], Shared(f"the replicated parameters of {label}", ["replicated parameters"],
                                          joint_digest(params), REPLICAS_ADVICE, detail=detail))

    def done(module: nn.Module, *_: Any) -> None:  # (also when the forward raised: nothing stale is left on the group)
        if module is not model or torch.compiler.is_compiling():
            return  # (nothing was carried)
        if not draws[0] and before[0] is not None and not torch.equal(generators_digest(), before[0]):
            draws[0] = True  # it drew random numbers (torch.rand* in its forward): carried from its next forward
        before[0] = None
        for key in keys:
            carry(pg, key, None)

    model.register_forward_hook(done, always_call=True)
    return model.register_forward_pre_hook(hook, with_kwargs=True)
