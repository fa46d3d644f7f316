"""An optimizer's state in a tplayers checkpoint: each state tensor laid out like its parameter.

A moment of a TP parameter (AdamW's ``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer``) has the
parameter's local shape and is split exactly like it, so it is saved as one more checkpoint entry
with the parameter's placement (``optimizer.state.<param name>.<key>``): every layout a checkpoint
takes (fused parts, padded vocabularies, KV-head replicas, uneven heads) reshards the moments too.
Scalars (``step``) are the same on every rank and stored once. The hyperparameters of each parameter
group (``lr``, ``betas`` ...) and which parameters it holds, by name, go in the manifest (JSON).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Tuple

import torch

from .stages import every_ranks
from .walk import CheckpointError, Entry

__all__ = ["PREFIX", "merged_record", "optimizer_entries", "optimizer_record", "optimizer_targets"]

PREFIX = "optimizer.state."


def _names(model_entries: List[Entry]) -> Dict[int, Entry]:
    return {id(e.tensor): e for e in model_entries}


def _groups(optimizer: torch.optim.Optimizer, by_id: Dict[int, Entry], what: str) -> List[List[str]]:
    """Each parameter group's parameters by model name; a parameter the model does not hold is refused."""
    out = []
    for i, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            if id(p) not in by_id:
                raise CheckpointError(f"{what}: the optimizer's parameter group {i} holds a tensor of shape "
                                      f"{tuple(p.shape)} that is not a parameter of the model (build the optimizer "
                                      "over model.parameters(), after parallelize or before it: the parameter "
                                      "objects are kept)")
            names.append(by_id[id(p)].name)
        out.append(names)
    return out


def _jsonable(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return {"tensor": value.item()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"{where}: {type(value).__name__} {value!r} cannot be recorded in the checkpoint manifest")


def _restored(saved: Any, current: Any) -> Any:
    """A manifest value back in the current group's type (tuples, tensors)."""
    if isinstance(saved, dict) and "tensor" in saved:
        return torch.tensor(saved["tensor"], dtype=current.dtype if isinstance(current, torch.Tensor) else None)
    if isinstance(saved, list) and isinstance(current, tuple):
        return tuple(saved)
    return saved


def _state_items(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> Dict[str, torch.Tensor]:
    state = optimizer.state.get(p, {})
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"optimizer state {bad} is not a tensor: tplayers checkpoints hold tensor state only")
    return state


def optimizer_entries(model_entries: List[Entry], optimizer: torch.optim.Optimizer) -> List[Entry]:
    """One checkpoint entry per state tensor, placed like its parameter (scalars replicated)."""
    by_id = _names(model_entries)
    _groups(optimizer, by_id, "save_checkpoint")
    out: List[Entry] = []
    for p, e in ((p, by_id[id(p)]) for g in optimizer.param_groups for p in g["params"]):
        for key, value in _state_items(optimizer, p).items():
            like = tuple(value.shape) == tuple(p.shape)
            if value.dim() and not like:
                raise CheckpointError(f"save_checkpoint: optimizer state '{key}' of '{e.name}' has shape "
                                      f"{tuple(value.shape)}, not its parameter's {tuple(p.shape)}: tplayers cannot "
                                      "say how it is split")
            out.append(Entry(f"{PREFIX}{e.name}.{key}", value, e.layout if like else None,
                             e.group if like else None, False))
    return out


def optimizer_record(model_entries: List[Entry], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The manifest's ``optimizer``: its class, each group's hyperparameters and parameter names, and each
    state tensor's dtype and whether it has its parameter's shape."""
    by_id = _names(model_entries)
    names = _groups(optimizer, by_id, "save_checkpoint")
    groups = []
    for group, params in zip(optimizer.param_groups, names):
        hyper = {k: _jsonable(v, f"save_checkpoint: optimizer hyperparameter '{k}'")
                 for k, v in group.items() if k != "params"}
        groups.append({"params": params, "hyper": hyper})
    state = {by_id[id(p)].name: {k: {"dtype": str(v.dtype).replace("torch.", ""), "like_param": v.dim() > 0}
                                 for k, v in _state_items(optimizer, p).items()}
             for g in optimizer.param_groups for p in g["params"]}
    return {"class": type(optimizer).__name__, "groups": groups, "state": state}


def merged_record(records: List[Dict[str, Any]], caller: str) -> Dict[str, Any]:
    """Every rank's :func:`optimizer_record` as the checkpoint's one (pipeline stages: each rank's optimizer holds
    its stage's parameters; TP and data-parallel peers hold the same): one class, the distinct groups, each
    parameter's state. Ranks holding one parameter must agree on its hyperparameters and state (the same on every
    rank: every rank merges every rank's)."""
    classes = sorted({r["class"] for r in records})
    if len(classes) > 1:
        raise CheckpointError(f"{caller}: the ranks' optimizers are of different classes {classes}")
    groups: List[Dict[str, Any]] = []
    hyper_of: Dict[str, Tuple[str, int]] = {}
    state: Dict[str, Any] = {}
    for rank, record in enumerate(records):
        for group in record["groups"]:
            if group not in groups:
                groups.append(group)
            hyper = json.dumps(group["hyper"], sort_keys=True)
            for name in group["params"]:
                if hyper_of.setdefault(name, (hyper, rank))[0] != hyper:
                    raise CheckpointError(f"{caller}: ranks {hyper_of[name][1]} and {rank} hold '{name}' in optimizer "
                                          "groups of different hyperparameters")
        for name, spec in record["state"].items():
            if state.setdefault(name, spec) != spec:
                raise CheckpointError(f"{caller}: ranks disagree on the optimizer state of '{name}'")
    return {"class": classes[0], "groups": groups, "state": state}


def optimizer_targets(record: Any, model_entries: List[Entry], optimizer: torch.optim.Optimizer,
                      path: str, pg: Any = None) -> Tuple[List[Entry], Callable[[], None]]:
    """(entries to load the saved state into, a function that hands it to the optimizer afterwards).
    Raises CheckpointError on every rank of ``pg``, naming what differs, when the checkpoint holds no optimizer state
    or another optimizer's (its class; a parameter it holds no state for; groups of one parameter saved with other
    hyperparameters; a parameter saved that no rank's optimizer holds: each rank may hold a pipeline stage's)."""
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: the checkpoint holds no optimizer state (saved without optimizer=); load "
                              "the model alone, or resume from a checkpoint saved with save_checkpoint(..., optimizer=)")
    if record.get("class") != type(optimizer).__name__:
        raise CheckpointError(f"{path}: the checkpoint holds {record.get('class')}'s state; this optimizer is "
                              f"{type(optimizer).__name__}")
    by_id = _names(model_entries)
    mine = _groups(optimizer, by_id, "load_checkpoint")
    hyper_of = {name: g["hyper"] for g in record["groups"] for name in g["params"]}
    problem = _groups_problem(mine, hyper_of)
    verdicts = every_ranks(pg, {"problem": problem, "held": sorted(n for g in mine for n in g)})
    bad = next(((r, v["problem"]) for r, v in enumerate(verdicts) if v["problem"]), None)
    if bad is not None:
        raise CheckpointError(f"{path}: the optimizer's parameter groups differ from the checkpoint's" +
                              (f" on rank {bad[0]}" if len(verdicts) > 1 else "") + f": {bad[1]}")
    unheld = sorted(set(hyper_of) - {n for v in verdicts for n in v["held"]})
    if unheld:
        raise CheckpointError(f"{path}: the optimizer's parameter groups differ from the checkpoint's: the state of "
                              f"{unheld[:4]}{' ...' if len(unheld) > 4 else ''} was saved and no rank's optimizer "
                              "holds them")
    targets: List[Entry] = []
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, p in enumerate(params):
        e = by_id[id(p)]
        for key, spec in record["state"].get(e.name, {}).items():
            dtype = getattr(torch, spec["dtype"])
            like = bool(spec["like_param"])
            t = torch.empty_like(p, dtype=dtype) if like else torch.zeros((), dtype=dtype)
            state.setdefault(index, {})[key] = t
            targets.append(Entry(f"{PREFIX}{e.name}.{key}", t, e.layout if like else None,
                                 e.group if like else None, False))

    def hand_over() -> None:
        groups = []
        start = 0
        for group, names in zip(optimizer.param_groups, mine):
            hyper = {k: _restored(v, group.get(k)) for k, v in hyper_of[names[0]].items()} if names else {}
            groups.append({**hyper, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    return targets, hand_over


def _groups_problem(mine: List[List[str]], hyper_of: Dict[str, Any]) -> str:
    """What keeps this rank's groups (parameter names) from taking the saved state: a parameter the checkpoint holds
    no state for, or one group's parameters saved with different hyperparameters; '' when nothing."""
    for i, names in enumerate(mine):
        missing = [n for n in names if n not in hyper_of]
        if missing:
            return f"group {i} holds {missing[:4]}, which the checkpoint's optimizer state does not"
        other = next((n for n in names if hyper_of[n] != hyper_of[names[0]]), None)
        if other is not None:
            return f"group {i} holds '{names[0]}' and '{other}', saved in groups of different hyperparameters"
    return ""
