"""A plan's attribute entries (``divide_attrs``, ``require_divisible``, ``set_attrs``) -> the changes to make.

The forward of a converted module reads head counts and widths from attributes (``n_head``, a config object's
``n_heads``, OLMo's ``fused_dims``, a KV cache shaped by the heads): these must follow this rank's heads. The
changes are computed (and checked) before ``parallelize`` swaps anything, and made after; the audit's dense twin
reads the values from before.
"""
from __future__ import annotations

import copy
import fnmatch
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn

from ..core.groups import TPGroup
from ..core.placement import kv_shards, require_divisible
from .plan import Plan
from .heads import getattr_path

__all__ = ["Change", "attr_changes"]

#: (module, attribute, its new value)
Change = Tuple[nn.Module, str, object]


def _attr_targets(modules: Dict[str, nn.Module], pattern: str) -> List[str]:
    """The modules an attribute entry's ``pattern`` names: those it matches that no ancestor of theirs matches
    too. (``*`` also matches dots, so ``"blocks.*"`` matches ``blocks.0`` and every module inside it; the
    attributes are those of the blocks.)"""
    named: List[str] = []
    for name in modules:
        if fnmatch.fnmatchcase(name, pattern) and not any(name.startswith(n + ".") for n in named if n):
            named.append(name)
    return named


def attr_changes(modules: Dict[str, nn.Module], plan: Plan, tp: TPGroup) -> List[Change]:
    """Check the plan's head-count attributes and return the changes to make (none made here)."""
    changes: List[Change] = []
    for pat, paths in plan.require_divisible.items():
        for name in _attr_targets(modules, pat):
            for path in paths:
                try:
                    value = getattr_path(modules[name], path)
                except AttributeError as e:
                    raise AttributeError(f"parallelize: module '{name}' ({pat!r}): {e}") from None
                require_divisible(value, tp.size, f"parallelize: module '{name}'", path)
    for pat, fn in plan.set_attrs.items():
        for name in _attr_targets(modules, pat):
            changes.extend((modules[name], attr, value) for attr, value in fn(modules[name], tp.size).items())
    for pat, attrs in plan.divide_attrs.items():
        for name in _attr_targets(modules, pat):
            changes.extend(_divided(modules[name], name, attrs, plan.name, tp))
    return changes


def _divided(module: nn.Module, name: str, attrs: Tuple[str, ...], plan_name: str, tp: TPGroup) -> List[Change]:
    """The changes dividing ``attrs`` of ``module`` by the TP degree. A dotted path (``config.n_head``) divides
    the attribute of a copy of each object on the way (a config object the layers share gets one copy per
    module, so the others, and the dense twin, keep the dense count). ``"cache_k:2"``: a tensor (a KV cache shaped
    by the heads) cut along dim 2 into this rank's part, a copy (the dense twin keeps the whole one)."""
    changes: List[Change] = []
    copies: Dict[str, Any] = {}  # dotted prefix -> this module's copy of the object there
    tp_size = tp.size
    for attr in attrs:
        optional, attr = attr.endswith("?"), attr.rstrip("?")
        attr, _, cut = attr.partition(":")
        try:
            value = getattr_path(module, attr)
        except AttributeError:
            if optional:
                continue
            raise AttributeError(f"parallelize: module '{name}' ({type(module).__name__}) has no attribute "
                                 f"'{attr}' that plan '{plan_name}' divides by the TP degree") from None
        if cut and cut != "kv":
            changes.append((module, attr, _cut_tensor(value, cut, f"parallelize: module '{name}'", attr, tp)))
            continue
        divided = (_local_kv_heads(value, f"parallelize: module '{name}'", attr, tp_size) if cut else
                   _divided_value(value, f"parallelize: module '{name}'", attr, tp_size))
        *path, last = attr.split(".")
        if not path:
            changes.append((module, attr, divided))
            continue
        owner: Any = module
        for i, part in enumerate(path):
            prefix = ".".join(path[:i + 1])
            if prefix not in copies:
                copies[prefix] = copy.copy(getattr(owner, part))
                if i == 0:
                    changes.append((module, part, copies[prefix]))
                else:
                    setattr(owner, part, copies[prefix])  # (owner is this module's own copy)
            owner = copies[prefix]
        setattr(owner, last, divided)
    return changes


def _divided_value(value: Any, where: str, attr: str, tp_size: int) -> Any:
    """An int divided by the TP degree, or a tuple / list of ints (OLMo's ``fused_dims``: the widths a fused
    projection's output is split by) divided element by element."""
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, int) for v in value):
        return type(value)(require_divisible(v, tp_size, where, f"{attr}[{i}]") for i, v in enumerate(value))
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: divide_attrs divides an int or a tuple of ints; '{attr}' is a "
                         f"{type(value).__name__} ({value!r}): set it with set_attrs, or cut a tensor with "
                         f"'{attr}:<dim>'")
    return require_divisible(value, tp_size, where, attr)


def _local_kv_heads(value: Any, where: str, attr: str, tp_size: int) -> int:
    """A KV-head count (``'n_kv_heads:kv'``) on one rank: divided by the TP degree, or 1 where there are fewer KV heads
    than ranks (each rank holds the one its query heads use, replicated on p / kv ranks: what ``KVColumn`` splits)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: divide_attrs '{attr}:kv' divides a KV-head count (an int); '{attr}' is a "
                         f"{type(value).__name__} ({value!r})")
    return value // kv_shards(value, tp_size, where, attr)


def _cut_tensor(value: Any, cut: str, where: str, attr: str, tp: TPGroup) -> torch.Tensor:
    """This rank's part of tensor ``value`` along dim ``cut`` (``divide_attrs`` ``"name:dim"``); ``"name:dim:kv"``: dim
    is KV heads, cut as ``KVColumn`` cuts them (fewer than the ranks: each rank keeps the one its query heads use)."""
    text, _, rule = cut.partition(":")
    if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter) or not text.lstrip("-").isdigit() \
            or rule not in ("", "kv"):
        raise ValueError(f"{where}: divide_attrs '{attr}:{cut}' cuts a tensor (not a parameter: the plan's layers "
                         f"own those) along an integer dim ('{attr}:2', or '{attr}:2:kv' for a dim of KV heads); "
                         f"'{attr}' is a {type(value).__name__}")
    dim = int(text)
    if not -value.dim() <= dim < value.dim():
        raise ValueError(f"{where}: divide_attrs '{attr}:{cut}': {attr} has {value.dim()} dims")
    if rule == "kv":
        shards = kv_shards(value.shape[dim], tp.size, where, f"{attr}.shape[{dim}] (KV heads)")
        return value.chunk(shards, dim)[tp.rank * shards // tp.size].clone()
    if value.shape[dim] % tp.size:
        hint = (f"; if that dim is KV heads, fewer than the ranks, '{attr}:{dim}:kv' keeps on each rank the head its "
                "query heads use (as KVColumn)" if value.shape[dim] < tp.size and tp.size % value.shape[dim] == 0 else "")
        raise ValueError(f"{where}: {attr}.shape[{dim}]={value.shape[dim]} is not divisible by the TP degree "
                         f"{tp.size}{hint}")
    return value.chunk(tp.size, dim)[tp.rank].clone()
