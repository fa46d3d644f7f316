"""Whole-model gradient utilities that read the placement contract: the global gradient norm (and
clipping) of a TP model, and an audit that replicated parameters and their gradients agree across ranks.

A parameter's placement says how to count it: a shard once per distinct piece (replicas of a KV head
counted once, not ``p / num_kv_heads`` times), a replicated parameter once (every rank holds all of
it). Parameters no TP module declares are replicated.
"""
from __future__ import annotations

import math
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ..core.blocking import all_gather_tensor, all_reduce_tensor, bit_hash, ranks_that_differ
from ..core.groups import GroupLike, TPGroup, collective_device, resolve_group
from ..core.placement import Placement, Sharded
from .base import TensorParallelModule, model_placements
from .optimizers import require_handed_off
from .switches import pending_wgrad

__all__ = ["clip_grad_norm_", "check_replicas"]

_CHUNK = 1 << 24  # elements per float64 chunk of a gradient norm (128 MiB)


def _model_group(model: nn.Module, group: GroupLike, fn: str) -> TPGroup:
    """The one TP group every TP module of ``model`` uses; ``group``, when given, must have its ranks
    (a wider group would count data-parallel replicas' norms too). Local: every rank raises alike."""
    groups = {id(m.group.process_group): m.group for m in model.modules() if isinstance(m, TensorParallelModule)}
    if group is None and len(groups) > 1:
        raise ValueError(f"{fn}: the model's TP modules use {len(groups)} different TP groups: pass group=")
    if group is None:
        return next(iter(groups.values())) if groups else resolve_group(None)
    given = resolve_group(group)
    if groups:
        own = next(iter(groups.values()))
        if given.global_ranks() != own.global_ranks():
            raise ValueError(f"{fn}: group= is not the TP group of the model's layers (ranks {own.global_ranks()}): it "
                             f"has ranks {given.global_ranks()}. Pass the model's TP group (e.g. mesh.tp_group), or leave "
                             "group=None to use it")
    return given


def _owned_pieces(t: torch.Tensor, placement: Placement, tp: TPGroup) -> Iterator[torch.Tensor]:
    """The pieces of the local tensor ``t`` of a sharded parameter that this rank counts: a piece
    held by several ranks (replicated KV heads) only on the first of them."""
    assert isinstance(placement, Sharded)
    for part, piece in zip(placement.parts, placement.pieces(tp.rank, tp.size)):
        if tp.rank in part.first_holders(tp.size):
            yield t.narrow(placement.dim, piece.local_start, piece.length)


def _require_module(model: object, fn: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: pass the model (an nn.Module), not {type(model).__name__}: whether a parameter is a "
                        "shard or a replica is read from the module that declares it, so bare parameters cannot be "
                        "counted right")
    return model


def _local_grad(name: str, g: torch.Tensor) -> Tuple[torch.Tensor, Optional[object]]:
    """(this rank's tensor of ``g``, the data-parallel mesh its norm must also be summed over).
    A plain gradient is its own local tensor; FSDP2's is a DTensor sharded over a 1-D dp mesh."""
    if not hasattr(g, "to_local"):
        return g, None
    if g.device_mesh.ndim != 1 or any(pl.is_partial() for pl in g.placements):
        raise ValueError(f"clip_grad_norm_: the gradient of '{name}' is a DTensor with placements {g.placements} "
                         f"on a {g.device_mesh.ndim}-D mesh; only FSDP2's (Shard or Replicate over one dp "
                         "dim) is understood")
    return g.to_local(), (g.device_mesh if any(pl.is_shard() for pl in g.placements) else None)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0, *,
                    group: GroupLike = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` of the dense model, on a TP model: the global norm of every
    gradient (each shard and each replicated parameter counted once), then every gradient scaled by
    ``min(1, max_norm / (norm + 1e-6))``. Returns the norm before clipping, on every rank.

    Collective over the TP group (one all-reduce of one number), on every rank even where this rank
    has no gradient; every rank gets the same norm. Under TP x DP with DDP the data-parallel
    gradients are already averaged, so the TP group is the whole story; with FSDP2 over the dp dim
    the gradients are DTensors sharded over dp, and their part of the norm is first summed over the
    dp mesh (one more all-reduce of one number per dp mesh). Equal to the dense clip in both cases
    (tests/test_parallel2d.py)."""
    model = _require_module(model, "clip_grad_norm_")
    require_handed_off(model.parameters(), "clip_grad_norm_", pending_wgrad(model))
    tp = _model_group(model, group, "clip_grad_norm_")
    placements = model_placements(model)
    grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    device = _local_grad(*grads[0])[0].device if grads else collective_device(tp.process_group)
    inf = math.isinf(norm_type)
    op = "max" if inf else "sum"

    def norm(t: torch.Tensor) -> torch.Tensor:  # sum |g|^q, or max |g| (0 for an empty dp shard)
        # in float64, _CHUNK elements at a time: a whole float64 copy of a big bf16 embedding's
        # gradient would take 4x its memory
        flat, acc = t.detach().reshape(-1), torch.zeros((), dtype=torch.float64, device=t.device)
        for start in range(0, flat.numel(), _CHUNK):
            piece = flat[start:start + _CHUNK].to(torch.float64).abs()  # never in place: .to may alias the grad
            acc = torch.maximum(acc, piece.max()) if inf else acc + piece.pow(norm_type).sum()
        return acc

    # Replicated gradients enter the one all-reduce as their average over the ranks (the max, for the inf
    # norm): the same value where the replicas agree, and where they do not (check_replicas finds that),
    # still one norm, so no two ranks clip by different factors.
    by_mesh: Dict[Optional[object], List[torch.Tensor]] = {None: [torch.zeros((), dtype=torch.float64, device=device)]}
    for name, g in grads:
        placement = placements.get(name)
        local, dp_mesh = _local_grad(name, g)
        if placement is not None and placement.is_sharded:
            if dp_mesh is None:
                contributions = [norm(t) for t in _owned_pieces(local, placement, tp)]
            elif all(part.shards == tp.size for part in placement.parts):
                # no piece is replicated over TP: the whole dp shard counts (padding rows are zero)
                contributions = [norm(local)]
            else:  # replicated KV pieces: gather the dp shards (this one parameter), then cut the pieces
                local, dp_mesh = g.full_tensor(), None
                contributions = [norm(t) for t in _owned_pieces(local, placement, tp)]
        else:
            contributions = [norm(local) if inf else norm(local) / tp.size]
        by_mesh.setdefault(dp_mesh, []).extend(contributions)

    def combine(ts: List[torch.Tensor]) -> torch.Tensor:
        return torch.stack(ts).max() if inf else torch.stack(ts).sum()

    local_total = combine(by_mesh.pop(None))
    for dp_mesh, ts in by_mesh.items():  # FSDP2: the dp shards' parts, summed over the dp mesh first
        dp_group = dp_mesh.get_group()  # type: ignore[attr-defined]
        part = all_reduce_tensor(combine(ts).to(collective_device(dp_group)), group=dp_group, op=op)
        local_total = combine([local_total, part.to(device)])
    # the collective runs on every rank, gradients or not: a rank skipping it would hang the others
    total = all_reduce_tensor(local_total.to(collective_device(tp.process_group)), group=tp, op=op).to(device)
    total_norm = total if inf else total.pow(1.0 / norm_type)
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for name, g in grads:
        local = _local_grad(name, g)[0]
        local.mul_(coef.to(local.dtype))
    return total_norm.to(grads[0][1].dtype if grads else torch.get_default_dtype())


ReplicaSets = Tuple[Tuple[int, ...], ...]


def _replica_items(model: nn.Module, tp: TPGroup, grads: bool) -> List[Tuple[str, Optional[torch.Tensor], ReplicaSets]]:
    """(label, tensor or None, replica sets) of everything that must be bitwise equal across some ranks;
    the replica sets: the ranks holding the same thing (all ranks, or the holders of each KV head).
    A gradient gets its entry even when it is None, so every rank lists the same items."""
    placements: Dict[str, Placement] = model_placements(model)
    items = []
    for name, p in model.named_parameters():
        placement = placements.get(name)
        kinds = [("value", p)] + ([("gradient", p.grad)] if grads else [])
        for kind, t in kinds:
            if placement is None or not placement.is_sharded:
                items.append((f"'{name}' {kind}", t, (tuple(range(tp.size)),)))
                continue
            for i, (part, piece) in enumerate(zip(placement.parts, placement.pieces(tp.rank, tp.size))):
                holders = part.holder_counts(tp.size)
                if max(holders) > 1:  # replicas of each piece on consecutive ranks (the label: the same on all)
                    local = None if t is None else t.narrow(placement.dim, piece.local_start, piece.length)
                    held = (f"a piece held by {holders[0]} ranks" if len(set(holders)) == 1
                            else f"pieces held by {'/'.join(map(str, holders))} ranks")
                    items.append((f"'{name}' {kind} (part {i}, {held})", local, part.replica_sets(tp.size)))
    return items


def _fingerprint(t: Optional[torch.Tensor]) -> torch.Tensor:
    """(present, hash, hash) of a tensor; (0, 0, 0) for a missing gradient."""
    if t is None:
        return torch.zeros(3, dtype=torch.int64)
    return torch.cat([torch.ones(1, dtype=torch.int64), bit_hash(t)])


def _mismatch(label: str, ranks: List[int], every: torch.Tensor, j: int) -> Optional[str]:
    """The message for item ``j`` if it differs among ``ranks``, else None."""
    differ = [r for r in ranks if not torch.equal(every[r, j], every[ranks[0], j])]
    if not differ:
        return None
    where = f"between rank {ranks[0]} and rank(s) {differ} of the TP group"
    missing = [r for r in ranks if int(every[r, j, 0]) == 0]
    if missing:
        return (f"{label} is missing (None) on rank(s) {missing} but not on the others {where}: a rank skipped the "
                "backward through this parameter, or zeroed its gradients differently")
    if "gradient" in label:
        return (f"{label} differs {where}; its gradient is a partial sum: a replicated parameter applied to sharded "
                "activations (a norm under sequence parallelism) needs its gradient all-reduced (ParallelNorm or "
                "the 'sequence_parallel_norm' style)")
    return (f"{label} differs {where}; the ranks hold different values: build the model under the same seed on "
            "every rank, or load the same checkpoint; TP ranks must also see the same batch")


def _nonzero_padding(model: nn.Module, tp: TPGroup, grads: bool) -> List[str]:
    """Labels of this rank's sharded parameters (and gradients) whose padding rows (past a shorter piece
    of an uneven split, or a padded vocabulary's last rows) are not all zero."""
    placements: Dict[str, Placement] = model_placements(model)
    bad = []
    for name, p in model.named_parameters():
        placement = placements.get(name)
        if not isinstance(placement, Sharded) or not any(part.is_uneven for part in placement.parts):
            continue
        for kind, t in [("value", p)] + ([("gradient", p.grad)] if grads else []):
            if t is None or t.shape[placement.dim] != placement.local_size:
                continue
            for part, piece in zip(placement.parts, placement.pieces(tp.rank, tp.size)):
                pad = t.narrow(placement.dim, piece.local_start + piece.length, part.local_size - piece.length)
                if pad.numel() and bool(pad.detach().ne(0).any()):
                    bad.append(f"'{name}' {kind}")
                    break
    return bad


@torch.no_grad()
def check_replicas(model: nn.Module, *, group: GroupLike = None, grads: bool = True) -> int:
    """Assert that every replicated parameter (and its gradient) is bitwise equal on every rank of the
    TP group, and every replicated piece of a sharded one (KV heads held by several ranks) on the ranks
    holding it; and that the padding rows of uneven splits (and of a padded vocabulary) are zero, value
    and gradient. Returns how many tensors it compared; raises AssertionError on every rank otherwise.

    Collective over the TP group: one all-gather of three int64 per tensor (after one of three int64
    proving that every rank lists the same parameters). Meant for a training
    loop's occasional audit (after backward, before the optimizer step): replicas drift apart silently
    when ranks start from different weights or seeds, see different batches, or a parameter applied to
    sharded activations (a norm under sequence parallelism) misses its gradient all-reduce."""
    model = _require_module(model, "check_replicas")
    if grads:
        require_handed_off(model.parameters(), "check_replicas", pending_wgrad(model))
    tp = _model_group(model, group, "check_replicas")
    items = _replica_items(model, tp, grads)
    if tp.size == 1:
        return len(items)
    # the fingerprints are gathered as one (n, 3) tensor: first make sure every rank lists the same
    # items (a model built differently on one rank would otherwise make the gather's shapes disagree)
    labels = "\n".join(label for label, _, _ in items).encode()
    listing = torch.cat([torch.tensor([len(items)]), bit_hash(torch.frombuffer(bytearray(labels) or bytearray(1),
                                                                                 dtype=torch.uint8))])
    differ = ranks_that_differ(listing[None], group=tp)[:, 0]
    if differ.any():
        raise AssertionError(f"check_replicas: rank(s) {differ.nonzero()[:, 0].tolist()} of the TP group list different "
                             f"parameters than rank 0 ({len(items)} replicated tensors to compare on this rank): "
                             "every rank must hold the same model, built the same way")
    padding = _nonzero_padding(model, tp, grads)
    # one more row, (nonzero padding tensors on this rank, 0, 0): every rank learns whether any rank has some
    local = torch.stack([_fingerprint(t) for _, t, _ in items] + [torch.tensor([len(padding), 0, 0])])  # (n + 1, 3)
    every = all_gather_tensor(local[None].to(collective_device(tp.process_group)), 0, group=tp).cpu()  # (p, n + 1, 3)
    dirty = every[:, -1, 0].nonzero()[:, 0].tolist()
    if dirty:
        mine = f" (here: {', '.join(padding)})" if padding else ""
        raise AssertionError(f"check_replicas: the zero padding of an uneven split is nonzero on rank(s) {dirty}{mine}: "
                             "the padding rows past a rank's piece must stay zero (a row-parallel layer masks its "
                             "padded input features; a weight loaded or set by hand must keep them zero)")
    for j, (label, _, sets) in enumerate(items):
        for ranks in sets:
            message = _mismatch(label, list(ranks), every, j)
            if message is not None:
                raise AssertionError(f"check_replicas: {message}")
    return len(items)
