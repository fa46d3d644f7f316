"""Parameters a converted module shares: tied inside the converted model (re-tied after the swap) or held by a
module outside it (refused).

A split parameter keeps its Parameter object (``param.data`` becomes this rank's shard: an optimizer built first
steps the TP model). A module outside the converted model that holds the same Parameter would then compute with
the shard as if it were whole, with no error:

    Before                                            Now
    parallelize(vlm.model.language_model, "auto")     ValueError naming 'embed_tokens.weight', 'lm_head' and the
    vlm.lm_head (tied) -> logits (b, s, V/p)          call that converts both (before anything changes)

Outside holders are found by who refers to the Parameter (``gc.get_referrers``, one scan of the heap, made only
when a split parameter has references beyond the converted model's own: ``sys.getrefcount``).
"""
from __future__ import annotations

import gc
import sys
from collections import Counter
from typing import Dict, List, Optional, Tuple

import torch.nn as nn

from ..layers.base import placements_of
from .styles import Built

__all__ = ["keep_parameter_objects", "ties_kept"]


def ties_kept(model: nn.Module, modules: Dict[str, nn.Module],
              built: Dict[str, Built]) -> List[Tuple[nn.Module, str, nn.Module, str]]:
    """The ties to restore after the swap (:func:`_inside_ties`), once no split parameter is also held by a module
    outside ``model`` (:func:`refuse_outside_holders`)."""
    refuse_outside_holders(model, modules, built)
    return _inside_ties(model, modules, built)


def refuse_outside_holders(model: nn.Module, modules: Dict[str, nn.Module], built: Dict[str, Built]) -> None:
    """ValueError naming a parameter the swap splits that a module outside ``model`` also holds (a head tied to
    the embedding of the text tower being converted), and that module."""
    split = {}  # id -> (dense name, the Parameter) of each parameter whose shape the swap changes
    for name, b in built.items():
        old = modules[name]
        if b.module is old:
            continue
        for pname, p_old in old._parameters.items():
            p_new = b.module._parameters.get(pname)
            if p_old is not None and p_new is not None and p_new.shape != p_old.shape:
                split[id(p_old)] = (f"{name}.{pname}" if name else pname, p_old)
    if not split:
        return
    p_old = p_new = None  # (no reference of this function's own but those counted below)
    inside = [m._parameters for m in model.modules()]
    held = Counter(id(v) for d in inside for v in d.values() if v is not None)
    # references beyond the inside dicts': the tuple in `split`, the loop's name, getrefcount's argument; more:
    # someone else holds it (one heap scan then finds who)
    if all(sys.getrefcount(p) - 3 <= held[i] for i, (_, p) in split.items()):
        return
    inside_ids = {id(d) for d in inside}
    for ref in gc.get_referrers(*(p for _, p in split.values())):
        if not isinstance(ref, dict) or id(ref) in inside_ids:
            continue
        holder = _owner(ref, "_parameters")
        if holder is None:
            continue  # (an optimizer's list, a user's variable: they hold the Parameter, which stays theirs)
        for pname, p in ref.items():
            if id(p) in split:
                raise ValueError(_outside_message(model, split[id(p)][0], holder, pname))


def _owner(d: dict, attr: str) -> Optional[nn.Module]:
    """The module whose ``attr`` (``_parameters``, ``_modules``) is ``d``, if any."""
    for ref in gc.get_referrers(d):
        if isinstance(ref, nn.Module) and vars(ref).get(attr) is d:
            return ref
        if isinstance(ref, dict) and ref.get(attr) is d:  # the module's __dict__
            for owner in gc.get_referrers(ref):
                if isinstance(owner, nn.Module) and owner.__dict__ is ref:
                    return owner
    return None


def _path(module: nn.Module) -> Tuple[nn.Module, str]:
    """(the outermost module holding ``module`` as a submodule, the dotted path to it there)."""
    parts: List[str] = []
    seen = {id(module)}
    while True:
        found = [(parent, key) for d in gc.get_referrers(module) if isinstance(d, dict)
                 if (parent := _owner(d, "_modules")) is not None for key, v in d.items() if v is module]
        if not found or id(found[0][0]) in seen:
            return module, ".".join(reversed(parts))
        module, key = found[0]
        parts.append(key)
        seen.add(id(module))


def _outside_message(model: nn.Module, name: str, holder: nn.Module, pname: str) -> str:
    root, holder_path = _path(holder)
    root_of_model, model_path = _path(model)
    where = type(root).__name__
    if root is root_of_model and model_path:
        where += f" ('{model_path}' is the module being converted)"
        call = f"parallelize(model, ...) on the {type(root).__name__} that holds both"
    else:
        call = "parallelize(model, ...) on a model that holds both"
    holder_name = f"'{holder_path}'" if holder_path else "a module"
    return (f"parallelize: '{name}' is split, and {holder_name} ({type(holder).__name__}, its '{pname}') outside the "
            f"module being converted holds the same Parameter, in {where}: it would compute with this rank's shard "
            f"as if it were whole, with no error (a head tied to the embedding of a text tower gives logits vocab / p "
            f"wide). Convert both together ({call}: its LM head is then split with the embedding), untie them "
            f"first (give '{holder_path or pname}' its own copy of the weight), or leave '{name}' whole in the plan")


def _inside_ties(model: nn.Module, modules: Dict[str, nn.Module],
          built: Dict[str, Built]) -> List[Tuple[nn.Module, str, nn.Module, str]]:
    """Tied parameters (one tensor, several names): both sides replaced with the same placement and
    shape (re-tied after the swap), or an error."""
    by_id: Dict[int, List[str]] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(pname)
    new = {n: b.module for n, b in built.items() if b.module is not modules[n]}  # the replaced modules
    retie = []
    for names in (ns for ns in by_id.values() if len(ns) > 1):
        owners = [(n.rpartition(".")[0], n.rpartition(".")[2]) for n in names]
        swapped = [o for o in owners if o[0] in new]
        if not swapped:
            continue
        if len(swapped) != len(owners):
            raise ValueError(f"parallelize: parameters {names} are tied (one tensor) but the plan swaps only "
                             f"{[m + '.' + a for m, a in swapped]}: swap all of them or none")
        (m0, a0), rest = owners[0], owners[1:]
        p0 = placements_of(new[m0]).get(a0)
        for m, a in rest:
            pm = placements_of(new[m]).get(a)
            if pm != p0 or getattr(new[m], a).shape != getattr(new[m0], a0).shape:
                raise ValueError(f"parallelize: tied parameters '{m0}.{a0}' and '{m}.{a}' get different TP placements "
                                 f"({p0} vs {pm}); they cannot stay tied")
            retie.append((new[m], a, new[m0], a0))
    return retie


def keep_parameter_objects(model: nn.Module, modules: Dict[str, nn.Module], built: Dict[str, Built]) -> None:
    """Each swapped module's direct parameters move into the dense Parameter objects of the same name
    they were built from (``param.data`` = this rank's shard), so whatever already holds the dense
    model's parameters (an optimizer built before ``parallelize``, a hook, a parameter list) holds the
    TP ones: an optimizer built first steps the TP model instead of orphaned dense tensors. Tied
    parameters stay tied (every reference to a replaced parameter is replaced)."""
    kept: Dict[int, nn.Parameter] = {}  # id(the TP layer's new parameter) -> the dense Parameter now holding it
    claimed: set = set()
    for name, b in built.items():
        old, new = modules[name], b.module
        if new is old:
            continue
        for pname, p_new in new.named_parameters(recurse=False):
            p_old = old._parameters.get(pname)
            if (p_old is None or id(p_new) in kept or id(p_old) in claimed or type(p_old) is not nn.Parameter
                    or p_old.requires_grad != p_new.requires_grad or p_old.device != p_new.device):
                continue
            p_old.data = p_new.data
            kept[id(p_new)] = p_old
            claimed.add(id(p_old))
    for module in model.modules():
        for pname, param in list(module._parameters.items()):
            if param is not None and id(param) in kept:
                module._parameters[pname] = kept[id(param)]
