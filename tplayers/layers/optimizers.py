"""What tplayers does around the optimizers of a TP model: their state of TP shards labelled as shards
(AdamW's moments of a sharded parameter as DTensors over the TP group in ``optimizer.state_dict()``, and
back to local tensors on load), and a step refused while gradients wait to be handed off (``delay_wgrad``'s
recorded work, ``main_grad`` buffers: :func:`require_handed_off`).

Why: the moments of a shard have the shard's shape. Handed out as plain tensors under the dense
parameter's name (``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``), DCP takes
the TP ranks' different moments for replicas of one tensor, writes one and gives it to every rank:
a resumed run trains on another rank's moments with no error. Labelled as DTensors, DCP writes each
shard once and reshards the moments at any TP size, as it does the parameters (``state_dict()`` of
a :class:`~tplayers.layers.base.TensorParallelModule`).

How: an optimizer cannot be found from the model, so the first ``step()`` of every optimizer in a
process that built a TP module attaches two hooks to it (``torch.optim``'s global step pre-hook;
DCP's ``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` step a fresh optimizer once,
with zero learning rate, before they read its state, so they always see the hooks):

- ``state_dict`` post-hook: each state tensor of a TP shard's shape becomes a DTensor (a view, no
  copy); a layout no DTensor describes (fused parts, KV-head replicas, uneven heads) raises
  :class:`~tplayers.core.dtensors.UnlabelledShard` naming ``tplayers.save_checkpoint(..., optimizer=)``;
- ``load_state_dict`` pre-hook: DTensors (and dense-shaped tensors) back to this rank's rows.

An optimizer that loads a state before its first step (the per-rank resume: a fresh optimizer,
``load_state_dict(torch.load(...))``) has no hooks yet: its first step, before it runs, turns the loaded
labels back into this rank's rows (:func:`_unlabel_loaded`), or refuses a label of another TP size by name.

Which parameter is a shard is read from the TP modules alive in the process when the state is
read (``param_placements()``), so parameters replaced after the optimizer was built (``to_empty``,
``load_state_dict(assign=True)``) are still found.
"""
from __future__ import annotations

import weakref
from itertools import chain
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ..core.dtensors import (UnlabelledShard, as_dtensor, as_dtensor_over_dp_tp, from_dtensor_over_dp_tp, is_dtensor,
                             local_rows, unlabelled_reason)
from ..core.groups import TPGroup
from ..core.placement import Placement
from ..core.wgrad import WeightGradStore

__all__ = ["track_tp_module", "shard_of", "require_handed_off", "MAIN_GRAD_IN_USE"]

_MODULES: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every TensorParallelModule alive in this process
_OPTIMIZERS: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers given the hooks
_STEP_HOOK: List[Any] = []  # the global step pre-hook's handle, once installed


MAIN_GRAD_IN_USE = [False]  # use_main_grad was called in this process: optimizer steps check the hand-off


def require_handed_off(params: Iterable[torch.Tensor], what: str, pending: int) -> None:
    """A RuntimeError naming the hand-off when gradients of ``params`` are not in ``.grad`` yet: ``pending``
    recorded weight-gradient computations (``delay_wgrad``; run by ``backward_dw``), or ``main_grad`` buffers
    holding gradients whose ``.grad`` is None (``use_main_grad``; handed over by ``main_grads_to_grads``).
    ``what`` (clipping, a replica check, an optimizer step) would otherwise run as if those were zero."""
    if pending:
        raise RuntimeError(f"{what}: {pending} weight-gradient computations recorded by delay_wgrad have not run, so "
                           "those weights' .grad does not hold this backward's gradient yet; call "
                           "tplayers.backward_dw(model) first (on every rank of the TP group)")
    if MAIN_GRAD_IN_USE[0]:
        unseen = sum(1 for p in params if getattr(p, "main_grad", None) is not None and p.grad is None
                     and bool(p.main_grad.any()))
        if unseen:
            raise RuntimeError(f"{what}: {unseen} parameters hold their gradient in main_grad buffers (use_main_grad) "
                               "and have no .grad; call tplayers.main_grads_to_grads(model) first (and "
                               "tplayers.zero_main_grads(model) after the optimizer step)")


def track_tp_module(module: Any) -> None:
    """Record a TP module (so its parameters' optimizer state is labelled); installs, once, the global
    optimizer step pre-hook that gives every optimizer the state hooks."""
    _MODULES.add(module)
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_HOOK.append(register_optimizer_step_pre_hook(_attach))


def _attach(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch.optim's global step pre-hook: the state hooks, once per optimizer; the hand-off check, each step."""
    if optimizer not in _OPTIMIZERS:
        _OPTIMIZERS.add(optimizer)
        optimizer.register_state_dict_post_hook(_label_state)
        optimizer.register_load_state_dict_pre_hook(_unlabel_state)
        _unlabel_loaded(optimizer)
    if WeightGradStore.pending_total or MAIN_GRAD_IN_USE[0]:  # two reads per step when neither is in use
        _require_gradients_handed_off(optimizer)


def _require_gradients_handed_off(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a step whose parameters' gradients wait in delay_wgrad's stores or in main_grad buffers."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    pending = 0
    if WeightGradStore.pending_total:  # which of the waiting work is this optimizer's (another model's may wait)
        ids = {id(p) for p in params}
        pending = sum(len(m.wgrad_store) for m in list(_MODULES)
                      if isinstance(getattr(m, "wgrad_store", None), WeightGradStore) and len(m.wgrad_store)
                      and any(id(p) in ids for p in m.parameters(recurse=False)))
    require_handed_off(params, "optimizer.step()", pending)


def shard_of(params: List[torch.Tensor]) -> Dict[int, Tuple[str, Placement, TPGroup]]:
    """``{id(param): (name, placement, group)}`` for the parameters among ``params`` that are TP shards
    (sharded placement, TP degree > 1) of a live TP module."""
    wanted = {id(p) for p in params}
    out: Dict[int, Tuple[str, Placement, TPGroup]] = {}
    for module in list(_MODULES):
        if module.group.size == 1:
            continue
        for name, placement in module.param_placements().items():
            p = module._parameters.get(name)
            if p is not None and id(p) in wanted and placement.is_sharded:
                out[id(p)] = (f"{type(module).__name__}.{name}", placement, module.group)
    return out


def _params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The optimizer's parameters in ``state_dict()``'s index order (first appearance)."""
    seen: Dict[int, torch.Tensor] = {}
    for p in chain.from_iterable(g["params"] for g in optimizer.param_groups):
        seen.setdefault(id(p), p)
    return list(seen.values())


def _label_state(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    params = _params(optimizer)
    shards = shard_of(params)
    if not shards:
        return None
    state = dict(state_dict["state"])
    for index, entry in state_dict["state"].items():
        p = params[index] if isinstance(index, int) and index < len(params) else None
        if p is None or id(p) not in shards:
            continue
        name, placement, group = shards[id(p)]
        what = (f"optimizer state of '{name}' (shape {tuple(p.shape)}, TP rank {group.rank} of {group.size})")
        if is_dtensor(p):  # FSDP2 over the TP model: its moments are DTensors over dp, labelled over (dp, tp)
            state[index] = {key: as_dtensor_over_dp_tp(value.detach(), placement, group, f"{what}, '{key}'")
                            if is_dtensor(value) and value.dim() > 0 else value for key, value in entry.items()}
            continue
        reason = unlabelled_reason(placement, group.size)
        if reason is not None:
            raise UnlabelledShard(
                f"{what}: this rank holds a shard that {reason}; the optimizer's state_dict() refuses to hand its "
                "moments out as the whole tensor's. Checkpoints that reshard, optimizer state included: "
                "tplayers.save_checkpoint(model, path, optimizer=...) / tplayers.load_checkpoint(..., optimizer=...)")
        labelled = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and not is_dtensor(value) and value.dim() > 0:
                if tuple(value.shape) != tuple(p.shape):
                    raise UnlabelledShard(f"{what}: state '{key}' has shape {tuple(value.shape)}, not the shard's: "
                                          "tplayers cannot say which rows of the dense tensor's state it holds")
                value = as_dtensor(value.detach(), placement, group)
            labelled[key] = value
        state[index] = labelled
    return {**state_dict, "state": state}


def _from_dp_tp(value: Any, placement: Placement, group: TPGroup, like: Any, what: str) -> Any:
    """A moment labelled over (dp, tp) back to FSDP2's DTensor over dp; FSDP2's own DTensor (tplayers.load_checkpoint
    hands those over) as it is."""
    if is_dtensor(value) and value.device_mesh == like.device_mesh:
        return value
    return from_dtensor_over_dp_tp(value, like, placement, group, what)


def _unlabel_state(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    saved = list(chain.from_iterable(g["params"] for g in state_dict.get("param_groups", [])))
    current = list(chain.from_iterable(g["params"] for g in optimizer.param_groups))
    if len(saved) != len(current):
        return None  # torch's own check names the mismatch
    by_index = dict(zip(saved, current))
    shards = shard_of(current)
    state = dict(state_dict["state"])
    for index, entry in state_dict["state"].items():
        p = by_index.get(index)
        if p is None or id(p) not in shards or not isinstance(entry, dict):
            continue
        state[index] = _local_entry(p, entry, shards[id(p)])
    return {**state_dict, "state": state}


def _local_entry(p: torch.Tensor, entry: Dict[str, Any], shard: Tuple[str, Placement, TPGroup]) -> Dict[str, Any]:
    """One parameter's optimizer state with its labelled (or dense-shaped) tensors back to this rank's rows."""
    name, placement, group = shard
    convert = _from_dp_tp if is_dtensor(p) else local_rows
    return {key: convert(value, placement, group, p.detach(), f"optimizer state '{key}' of '{name}'")
            if isinstance(value, torch.Tensor) and value.dim() > 0 else value
            for key, value in entry.items()}


def _unlabel_loaded(optimizer: torch.optim.Optimizer) -> None:
    """At an optimizer's first step, its state loaded before tplayers' hooks were attached (the per-rank resume:
    ``torch.save(optimizer.state_dict())``, a fresh optimizer, ``load_state_dict(torch.load(...))``): the
    labelled moments back to this rank's rows, as the load pre-hook does for an optimizer that has stepped.
    A DTensor beside a parameter that is no TP shard (state saved at another TP size) is refused by name:
    torch's own error ("mixed torch.Tensor and DTensor") would say nothing of the route."""
    loaded = [p for p, entry in optimizer.state.items() if isinstance(entry, dict)
              and any(is_dtensor(v) for v in entry.values())]
    if not loaded:
        return  # a fresh optimizer's state is empty: one scan of nothing
    shards = shard_of(loaded)
    index = {id(p): i for i, p in enumerate(_params(optimizer))}
    for p in loaded:
        entry = optimizer.state[p]
        if id(p) in shards:
            optimizer.state[p] = _local_entry(p, entry, shards[id(p)])
        elif not is_dtensor(p):
            key, value = next((k, v) for k, v in entry.items() if is_dtensor(v))
            raise ValueError(
                f"optimizer state '{key}' of parameter {index.get(id(p))} (shape {tuple(p.shape)}): a DTensor of "
                f"shape {tuple(value.shape)} placed {tuple(value.placements)} over ranks "
                f"{value.device_mesh.mesh.flatten().tolist()}, a TP shard's state; this parameter is "
                f"{_what_holds(p)}. A per-rank optimizer state_dict() loads back at the TP size and rank that saved "
                "it; at another TP size load it through torch.distributed.checkpoint (get_state_dict / "
                "set_state_dict, which reshard) or tplayers.save_checkpoint / load_checkpoint(..., optimizer=...)")


def _what_holds(p: torch.Tensor) -> str:
    """How a parameter that is no TP shard is held, for the refusal above."""
    for module in list(_MODULES):
        for name, q in module._parameters.items():
            if q is p:
                placement = module.param_placements().get(name)
                kind = "sharded" if placement is not None and placement.is_sharded else "replicated"
                return (f"'{type(module).__name__}.{name}', {kind} at TP size {module.group.size} "
                        f"(TP rank {module.group.rank})")
    return "a plain tensor of no TP module"
