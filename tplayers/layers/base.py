"""What every tplayers module shares: its TP group, dense conversion, and its parameters' placements.

A :class:`TensorParallelModule` declares, for each direct parameter, its
:class:`~tplayers.core.placement.Placement`; :func:`model_placements` reads them for a whole model
(plus any placement a ``parallelize`` style recorded on a foreign module), and everything that moves
weights between dense and sharded form reads that map.
"""
from __future__ import annotations

import fnmatch
import sys
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..core.blocking import gather_placed
from ..core.dtensors import (UnlabelledShard, as_dtensor, as_dtensor_over_dp_tp, from_dtensor_over_dp_tp, is_dtensor,
                             local_rows, unlabelled_reason)
from ..core.groups import GroupLike, TPGroup
from ..core.placement import Placement
from .optimizers import track_tp_module

__all__ = ["class_name", "TensorParallelModule", "model_placements", "placements_of", "PLACEMENTS_ATTR", "SHARD_OWNER_KEY",
           "mixed_class", "module_copy", "params_read_as", "route_params_through",
           "carry_hooks", "has_foreign_hooks"]

# A module that is not a TensorParallelModule (a Hugging Face norm under sequence parallelism) carries
# its parameters' placements in this attribute, set by the parallelize style that changed how it runs.
PLACEMENTS_ATTR = "_tplayers_placements"
SHARD_OWNER_KEY = "tplayers_shards"  # in a state_dict's metadata: whose shards it holds


class TensorParallelModule(nn.Module):
    """Base of every tplayers module: it knows its TP group and converts to and from dense.

    ``to_dense()`` is collective (every rank of the group must call it) and returns a plain
    ``torch.nn`` module computing the same function, on every rank.
    """

    group: TPGroup

    def __new__(cls, *args: Any, **kwargs: Any) -> "TensorParallelModule":
        module = super().__new__(cls)
        track_tp_module(module)  # its shards' optimizer state is labelled as shards (layers/optimizers.py)
        return module

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "TensorParallelModule":
        raise NotImplementedError

    def to_dense(self) -> nn.Module:
        raise NotImplementedError

    def param_placements(self) -> Dict[str, Placement]:
        """Each direct parameter's :class:`~tplayers.core.placement.Placement`. A container module
        (its parameters all live in child TP modules) has none; a module with direct parameters
        must say how each one is placed."""
        direct = [name for name, _ in self.named_parameters(recurse=False)]
        if direct:
            raise NotImplementedError(f"{type(self).__name__} has parameters {direct} but does not define "
                                      "param_placements()")
        return {}

    def gather_param(self, name: str) -> torch.Tensor:
        """The dense tensor of direct parameter ``name``, on every rank (collective; no autograd)."""
        return gather_placed(getattr(self, name), self.param_placements()[name], group=self.group)

    # state_dict(): every sharded parameter is a DTensor over the TP group (its dense shape, Shard(dim)), so
    # torch.save, DCP (get_model_state_dict / dcp.save) and any other reader see a shard labelled as one;
    # a layout no DTensor describes is refused, naming the tplayers route. The state_dict's metadata also
    # records whose shards it holds (torch.save keeps it, load_state_dict's strictness ignores it): a load
    # refuses another rank's or another TP size's (a DTensor's local tensor, or a plain shard of an older
    # state_dict, would otherwise be taken as this rank's, computing wrong numbers with no error).
    def _shard_owner(self) -> Optional[Dict[str, Any]]:
        placements = {n: repr(pl) for n, pl in self.param_placements().items() if pl.is_sharded}
        if not placements:
            return None  # nothing sharded: any rank's copy is this rank's
        return {"tp_rank": self.group.rank, "tp_size": self.group.size, "placements": placements}

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.group.size > 1:
            for name, placement in self.param_placements().items():
                key = prefix + name
                if placement.is_sharded and destination.get(key) is not None:
                    destination[key] = self._labelled(key, destination[key], placement)
        owner = self._shard_owner()
        metadata = getattr(destination, "_metadata", None)
        if owner is not None and metadata is not None and prefix[:-1] in metadata:
            metadata[prefix[:-1]][SHARD_OWNER_KEY] = owner

    def _labelled(self, key: str, value: torch.Tensor, placement: Placement) -> Any:
        what = f"'{key}' ({type(self).__name__}, TP rank {self.group.rank} of {self.group.size})"
        if is_dtensor(value):  # FSDP2 over the TP model: labelled over the (dp, tp) mesh
            return as_dtensor_over_dp_tp(value.detach(), placement, self.group, what)
        reason = unlabelled_reason(placement, self.group.size)
        if reason is not None:
            raise UnlabelledShard(
                f"{what}: this rank holds a shard that {reason}; state_dict() refuses to hand it out as the whole "
                "tensor. Checkpoints that reshard, optimizer state included: tplayers.save_checkpoint(model, path, "
                "optimizer=...) / tplayers.load_checkpoint; the dense tensors: tplayers.io.dense_state_dict(model) "
                "or tplayers.save_dense")
        return as_dtensor(value.detach(), placement, self.group)

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any],
                              strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        saved, mine = local_metadata.get(SHARD_OWNER_KEY), self._shard_owner()
        if saved is not None and mine is not None and saved != mine:
            what = f"{type(self).__name__} '{prefix[:-1]}'"
            if (saved.get("tp_rank"), saved.get("tp_size")) != (mine["tp_rank"], mine["tp_size"]):
                error_msgs.append(
                    f"{what}: this state_dict holds TP rank {saved.get('tp_rank')} of {saved.get('tp_size')}'s shard; "
                    f"this module is TP rank {mine['tp_rank']} of {mine['tp_size']}. A TP model's state_dict is "
                    "per rank: save and load it on every rank (one file per rank), or use "
                    "tplayers.save_checkpoint / load_checkpoint (any TP size) or save_dense / load_dense")
                return
            error_msgs.append(f"{what}: this state_dict's shards are placed {saved.get('placements')}, this module's "
                              f"{mine['placements']}: a different layout of the same parameters")
            return
        for name, placement in self.param_placements().items():
            key, local = prefix + name, self._parameters.get(name)
            if not placement.is_sharded or key not in state_dict or local is None:
                continue
            if is_dtensor(local) and self.group.size == 1:
                continue  # FSDP2 over a TP-1 layer: its DTensor's global tensor is the dense one, as saved
            try:  # a DTensor (DCP, a state_dict() of this layout) or the dense tensor -> this rank's rows
                state_dict[key] = (from_dtensor_over_dp_tp(state_dict[key], local.detach(), placement, self.group,
                                                           f"'{key}'") if is_dtensor(local) else
                                   local_rows(state_dict[key], placement, self.group, local.detach(), f"'{key}'"))
            except ValueError as e:
                error_msgs.append(str(e))
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def class_name(obj: object) -> str:
    """The class of ``obj`` as errors name it: ``nn.Linear`` for torch's, else with its module
    (``gemma.model.Linear``): a library's own ``Linear`` must not read as torch's in "is a Linear; needs an
    nn.Linear"."""
    cls = obj if isinstance(obj, type) else type(obj)
    if cls.__module__.startswith("torch.nn"):
        return f"nn.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def placements_of(module: nn.Module) -> Dict[str, Placement]:
    """The placements of ``module``'s direct parameters that differ from plain replication."""
    if isinstance(module, TensorParallelModule):
        return module.param_placements()
    return dict(getattr(module, PLACEMENTS_ATTR, {}))


def model_placements(model: nn.Module) -> Dict[str, Placement]:
    """``{parameter name: Placement}`` for every parameter of ``model`` with a declared placement
    (names absent from it are replicated with a complete gradient). Pure: no communication."""
    out: Dict[str, Placement] = {}
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for pname, placement in placements_of(mod).items():
            out[prefix + pname] = placement
    return out


_MIXED: Dict[Tuple[type, type], type] = {}


def mixed_class(tp_cls: type, dense_cls: type) -> type:
    """``tp_cls`` mixed into a family's own module class (``ParallelExperts[MixtralExperts]``): its
    forward and attributes are the family's, ``tp_cls`` adds the TP behaviour. One per pair, registered in
    ``tp_cls``'s module under its name (pickle looks classes up by name)."""
    if (tp_cls, dense_cls) not in _MIXED:
        home = sys.modules[tp_cls.__module__]
        name = f"{tp_cls.__name__}[{dense_cls.__qualname__}]"
        if hasattr(home, name):  # two families' classes of one name
            name = f"{tp_cls.__name__}[{dense_cls.__module__}.{dense_cls.__qualname__}]"
        cls = type(name, (tp_cls, dense_cls), {"__module__": tp_cls.__module__, "__qualname__": name})
        setattr(home, name, cls)
        _MIXED[(tp_cls, dense_cls)] = cls
    return _MIXED[(tp_cls, dense_cls)]


def module_copy(module: nn.Module, cls: type) -> nn.Module:
    """A new ``cls`` object with ``module``'s attributes; nn.Module's own dicts (parameters, buffers,
    submodules, hooks) copied, so changing the copy's parameters leaves ``module`` as it is."""
    new = object.__new__(cls)
    if issubclass(cls, TensorParallelModule):
        track_tp_module(new)
    new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
    return new


def _shadow(reads: Iterable[Tuple[nn.Module, str, torch.Tensor]]) -> None:
    """``module.<name>`` reads as the tensor given: it is put in the instance ``__dict__``, which attribute lookup
    finds before ``nn.Module.__getattr__`` reads ``_parameters`` (state-dict names, the parameters unchanged)."""
    for module, name, value in reads:
        module.__dict__[name] = value


def _unshadow(names: Iterable[Tuple[nn.Module, str]]) -> None:
    for module, name in names:
        module.__dict__.pop(name, None)


@contextmanager
def params_read_as(reads: Iterable[Tuple[nn.Module, str, torch.Tensor]]) -> Iterator[None]:
    """While the body runs, ``module.<name>`` reads as the tensor given for each ``(module, name, tensor)``, and
    as the parameter again afterwards, also when the body raises. For code that reads a parameter directly (a
    family's forward reading ``self.conv1d.weight``) where TP needs a function of it (its replicas' gradients
    summed, padding rows masked)."""
    reads = list(reads)
    _shadow(reads)
    try:
        yield
    finally:
        _unshadow((module, name) for module, name, _ in reads)


def route_params_through(module: nn.Module, names: Tuple[str, ...], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """During each forward of ``module``, ``module.<name>`` reads as ``fn(parameter)`` for each of ``names``
    (:func:`params_read_as` around every forward, by a pre-hook and a forward hook also called when forward
    raises). The parameter is read anew each forward, so replacing it (``to_empty``, loading) keeps the
    routing."""

    def pre_hook(m: nn.Module, args: tuple) -> None:
        _shadow((m, name, fn(param)) for name in names if (param := m._parameters.get(name)) is not None)

    def post_hook(m: nn.Module, args: tuple, out: object) -> None:
        _unshadow((m, name) for name in names)

    module.register_forward_pre_hook(pre_hook)
    module.register_forward_hook(post_hook, always_call=True)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_hooks", "_backward_pre_hooks")


def has_module_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has hooks of its own (forward, pre-forward, backward): code that sees its inputs or outputs."""
    return any(getattr(module, attr, None) for attr in _HOOK_DICTS)


_CALLED = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")  # (the others: flags)
_GLOBAL = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks")


def has_foreign_hooks(module: Optional[nn.Module] = None) -> bool:
    """Whether ``module`` (None: the global module hooks) has a hook tplayers did not register: code that may read its
    inputs' or outputs' values (tplayers' own read identities, shapes and sites)."""
    owner, names = (torch.nn.modules.module, _GLOBAL) if module is None else (module, _CALLED)
    for name in names:
        hooks = getattr(owner, name, None)
        if hooks and any(not str(getattr(getattr(h, "__func__", h), "__module__", "")).startswith("tplayers.")
                         for h in hooks.values()):
            return True
    return False


def sharded_parameters(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter of ``model``'s TP layers that holds this rank's shard."""
    placements = model_placements(model)
    return [(n, p) for n, p in model.named_parameters() if n in placements and placements[n].is_sharded]


class ShardIndex:
    """The sharded parameters of a model's TP layers, to tell whether a tensor is one of them: the parameter itself,
    a view of it (``_base``: made at any time, before ``parallelize`` too, when it still shows the dense values)
    or a tensor sharing its storage (``.detach()``, ``.data``)."""

    def __init__(self, model: nn.Module, skip: Sequence[str] = ()) -> None:
        self.by_id = {id(p): (n, p) for n, p in sharded_parameters(model)
                      if not any(fnmatch.fnmatchcase(n, pat) for pat in skip)}  # (skip: reads declared by design)
        self.by_storage = {_storage(p): (n, p) for n, p in self.by_id.values()}
        self.by_storage.pop(None, None)

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def find(self, t: torch.Tensor) -> Optional[Tuple[str, torch.Tensor]]:
        """(how ``t`` holds a shard: "'name'" or "a view of 'name'", the parameter), or None."""
        hit = self.by_id.get(id(t))
        if hit is not None:
            return f"'{hit[0]}'", hit[1]
        storage = _storage(t)
        hit = self.by_id.get(id(t._base)) if t._base is not None else None
        if hit is None:
            hit = self.by_storage.get(storage)
        if hit is None:
            return None
        stale = storage != _storage(hit[1])
        return (f"a view of '{hit[0]}' made before parallelize (it shows the dense values of then: never trained)"
                if stale else f"a view of '{hit[0]}'"), hit[1]


def _storage(t: torch.Tensor) -> Optional[int]:
    """Where ``t``'s storage starts, or None where it has none to read (empty, a DTensor or other subclass, FSDP2's
    freed parameters between forwards)."""
    if not t.numel() or type(t) not in (torch.Tensor, nn.Parameter):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


CARRIED_ATTR = "_tplayers_carried_attributes"  # the names carry_attributes gave a swapped-in module


def carry_attributes(src: nn.Module, dst: nn.Module, names: Optional[Iterable[str]] = None) -> List[str]:
    """Give ``dst`` the plain attributes of ``src`` it does not have (a reference-style Linear's ``scale``, None
    outside fp8; a block size): the model's code that reads them from the swapped module reads the same values.
    Modules and parameters are not carried (the TP layer holds its own). ``names``: only those (default: all).
    Returns the names carried, also kept on ``dst`` (``CARRIED_ATTR``: a region's dense twin carries them on to
    the layer's ``to_dense()``)."""
    carried = []
    for name in list(vars(src)) if names is None else [n for n in names if n in vars(src)]:
        value = vars(src)[name]
        if name.startswith("_") or isinstance(value, (nn.Module, nn.Parameter)) or hasattr(dst, name):
            continue
        setattr(dst, name, value)
        carried.append(name)
    if carried:
        vars(dst)[CARRIED_ATTR] = carried
    return carried


def carry_hooks(src: nn.Module, dst: nn.Module, skip: Iterable[int] = ()) -> int:
    """Give ``dst`` the forward and backward hooks registered on ``src`` (same ids, same order; the hook
    functions receive ``dst`` from now on), except the ids in ``skip``. A module swapped for its TP layer
    keeps what user code hooked on it (activation steering, gradient scaling); a region's dense twin runs
    the hooks its TP layers carry. Returns how many hooks it carried."""
    skip = set(skip)
    count = 0
    for attr in _HOOK_DICTS:
        hooks = getattr(src, attr, None)
        if not hooks:
            continue
        for hook_id, value in hooks.items():
            if hook_id in skip or hook_id in getattr(dst, attr):
                continue
            getattr(dst, attr)[hook_id] = value
            count += attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
    if src._backward_hooks and getattr(src, "_is_full_backward_hook", None) is not None:
        dst._is_full_backward_hook = src._is_full_backward_hook
    return count
