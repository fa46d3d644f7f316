"""A converted region's dense twin, and running a region on a copy of its inputs (for the audit).

The **dense twin** of a region is what it computed before ``parallelize``: a copy with every TP layer
replaced by its ``to_dense()``, the attributes ``parallelize`` (or the user) changed since restored, and
the hooks ``parallelize`` added removed. :func:`run_region` runs a region forward and backward on copied
inputs (``autograd.grad``: no ``.grad`` written) inside :class:`Quiet` (eval mode, forked RNG, autocast
off), so the model, its buffers and the training's random stream stay as they were.
"""
from __future__ import annotations

import copy
import sys
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..core.blocking import all_gather_tensor
from ..core.groups import TPGroup
from ..layers.base import CARRIED_ATTR, PLACEMENTS_ATTR, TensorParallelModule, carry_attributes, carry_hooks
from .invariant import LEAF_FORWARD, declare_twins_alike, leaves_at_tp1, tp1_twin

__all__ = ["within", "forked_rng", "float32_copy", "copy_inputs", "gather_first", "first_float", "Quiet", "Kept", "run_region",
           "random_like",
           "dense_twin", "relative_error", "scale_of"]


def within(name: str, ancestor: str) -> bool:
    """Module ``name`` is ``ancestor`` or inside it ("" is the root)."""
    return ancestor == "" or name == ancestor or name.startswith(ancestor + ".")


def _tensors_in(obj: Any, depth: int = 6) -> List[torch.Tensor]:
    """The tensors reachable from ``obj`` through attributes, lists, tuples and dicts (``depth`` levels)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0 or isinstance(obj, (int, float, bool, str, bytes, type(None), nn.Module)):
        return []
    if isinstance(obj, dict):
        children: Any = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
    return [t for child in children for t in _tensors_in(child, depth - 1)]


def float32_copy(module: nn.Module) -> nn.Module:
    """A float32 copy of a TP region that still communicates over the same TP groups."""
    memo: Dict[int, Any] = {id(m.group): m.group for m in module.modules() if isinstance(getattr(m, "group", None), TPGroup)}
    return copy.deepcopy(module, memo).float()


def copy_inputs(args: tuple, kwargs: dict, cast: Optional[torch.dtype] = None
                 ) -> Tuple[tuple, dict, List[torch.Tensor]]:
    """Detached copies of the call's tensors (floating ones cast to ``cast`` if given; those that
    required grad, else the first floating one, become leaves that require grad), everything else
    deep-copied (caches are written to)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    floating = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    want = [i for i in floating if leaves[i].requires_grad] or floating[:1]
    memo: Dict[int, Any] = {}
    out, diff = [], []
    def copied(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if cast is None or not t.is_floating_point() else t.detach().to(cast)

    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            t = copied(leaf)
            if i in want:
                t.requires_grad_(True)
                diff.append(t)
            memo[id(leaf)] = t
            out.append(t)
        else:
            out.append(leaf)
    for i, leaf in enumerate(out):
        if not isinstance(leaf, (torch.Tensor, int, float, bool, str, type(None))):
            for t in _tensors_in(leaf):  # a KV cache may hold tensors autograd made (deepcopy refuses those)
                memo.setdefault(id(t), copied(t))
            out[i] = copy.deepcopy(leaf, memo)
    a, k = pytree.tree_unflatten(out, spec)
    return a, k, diff


def gather_first(args: tuple, kwargs: dict, tp: TPGroup, dim: int) -> Tuple[tuple, dict, List[torch.Tensor]]:
    """The call with its first floating tensor all-gathered along ``dim`` (a leaf requiring grad)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    i = next(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point())
    leaves[i] = all_gather_tensor(leaves[i].detach().contiguous(), dim, group=tp).requires_grad_(True)
    diff = [leaves[i]] + [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t is not leaves[i]]
    a, k = pytree.tree_unflatten(leaves, spec)
    return a, k, diff


def first_float(tree: Any) -> Optional[torch.Tensor]:
    return next((t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


def forked_rng() -> Any:
    """``torch.random.fork_rng`` over the CPU generator and, once CUDA is in use, the current device's: the random
    stream as it was after the block."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=devices)


class Quiet:
    """Eval mode, no delayed weight gradients or main_grad accumulation, a forked RNG, autocast off:
    the audit's runs leave the model, its buffers and the training's random stream as they were."""

    def __init__(self, *modules: nn.Module) -> None:
        self.modules = modules

    def __enter__(self) -> "Quiet":
        self.saved = []
        for root in self.modules:
            for m in root.modules():
                self.saved.append((m, "training", m.training))
                for attr in ("delay_wgrad", "accumulate_main_grad"):
                    if isinstance(getattr(m, attr, None), bool):
                        self.saved.append((m, attr, getattr(m, attr)))
                        setattr(m, attr, False)
                m.training = False
        self.rng = forked_rng()
        self.rng.__enter__()
        self.grad = torch.enable_grad()
        self.grad.__enter__()
        # the innermost saved-tensor hooks apply: identity ones keep the audit's tensors out of an enclosing
        # activation checkpoint (which would count them and fail its recomputation) or offloading
        self.saved_hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        self.saved_hooks.__enter__()
        # autocast off: a plan's faults do not depend on the precision, and mixed-precision rounding
        # would hide them under a loose tolerance (the region runs in its parameters' dtype)
        self.autocast = [torch.autocast(d, enabled=False) for d in ("cpu", "cuda")
                         if d == "cpu" or torch.cuda.is_available()]
        for a in self.autocast:
            a.__enter__()
        # Hugging Face collects output_hidden_states / output_attentions through forward hooks on its layers: the
        # audit's runs of a region (and of its twin, which copies them) must not add entries to the user's outputs
        capture = sys.modules.get("transformers.utils.output_capturing")
        self.collector = getattr(capture, "_active_collector", None)
        self.collector_token = self.collector.set(None) if self.collector is not None else None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.collector is not None:
            self.collector.reset(self.collector_token)
        for a in reversed(self.autocast):
            a.__exit__(*exc)
        self.saved_hooks.__exit__(*exc)
        self.grad.__exit__(*exc)
        self.rng.__exit__(*exc)
        for m, attr, value in self.saved:
            setattr(m, attr, value)


class Kept:
    """The state a run may write, put back after it: each module's buffers and tensor attributes are replaced by
    copies for the run (a KV cache written in place in forward: the run writes to its copy, the model's own is
    neither changed nor given the run's graph), its plain attributes (a position counter) restored, attributes
    the run added removed. The originals are never written to (their version counters, saved by a forward not yet
    backpropagated, stay)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> "Kept":
        self.saved = []
        for m in self.module.modules():
            buffers = dict(m._buffers)
            m._buffers.update({k: _copy(v) for k, v in buffers.items() if v is not None})
            state = {k: v for k, v in vars(m).items() if not k.startswith("_")}
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) or isinstance(v, (list, dict)):
                    vars(m)[k] = _copy(v)
            self.saved.append((m, buffers, state))
        return self

    def __exit__(self, *exc: Any) -> None:
        for m, buffers, state in self.saved:
            m._buffers.clear()
            m._buffers.update(buffers)
            for k in [k for k in vars(m) if not k.startswith("_") and k not in state]:
                del vars(m)[k]
            vars(m).update(state)


def _copy(v: Any) -> Any:
    """A tensor cloned (detached), a list or dict of tensors copied with them, anything else as it is."""
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, list):
        return [_copy(x) for x in v]
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    return v


def run_region(module: nn.Module, args: tuple, kwargs: dict, diff: List[torch.Tensor], grad_for: Any
               ) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]], Dict[int, Optional[torch.Tensor]]]:
    """Forward, then backward of ``grad_for(output)``: (output, input grads, {id(param): grad})."""
    out = first_float(module(*args, **kwargs))
    if out is None:
        raise TypeError("its output holds no floating-point tensor to compare")
    params = [p for p in module.parameters() if p.requires_grad]
    targets = list(diff) + params
    grads = torch.autograd.grad([out], targets, [grad_for(out)], allow_unused=True) if out.requires_grad and targets \
        else [None] * len(targets)
    return out.detach(), list(grads[:len(diff)]), {id(p): g for p, g in zip(params, grads[len(diff):])}


def random_like(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """The output gradient both runs backpropagate: the same on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(tuple(shape), generator=gen, dtype=like.dtype).to(like.device)


def dense_twin(region: nn.Module, originals: Dict[str, Dict[str, Any]], added_hooks: Dict[str, Set[int]],
               group: Optional[TPGroup] = None) -> nn.Module:
    """``region`` with every TP layer replaced by its ``to_dense()`` (collective, in module order), the
    attributes ``originals`` records (relative module path -> name -> value before ``parallelize``)
    restored (a tensor the plan cut, a KV cache: this rank's part now, all-gathered over ``group``), and without the
    hooks ``parallelize`` added (``added_hooks``: relative path -> hook ids).
    A ``tp_invariant`` region's twin is what it computes at TP 1: its TP layers at TP 1 on the fixed-tree path
    (`tplayers.convert.invariant.tp1_twin`), its modules run leaf by leaf with TP 1's leaves."""
    memo: Dict[int, Any] = {}
    outer: List[str] = []
    layers: List[nn.Module] = []  # the TP layers replaced, in module order
    for rel, m in region.named_modules():
        if isinstance(m, TensorParallelModule) and not any(within(rel, o) for o in outer):
            outer.append(rel)
            layers.append(m)
            memo[id(m)] = tp1_twin(m) if getattr(m, "tp_invariant", False) else m.to_dense()
            carry_hooks(m, memo[id(m)], skip=added_hooks.get(rel, ()))  # the user's hooks run in the twin too
            carry_attributes(m, memo[id(m)], vars(m).get(CARRIED_ATTR, ()))  # (those the swap carried)
    declare_twins_alike(memo, layers)
    if "" in outer:
        return memo[id(region)]
    for m in region.modules():  # tensors computed from others (a KV cache) have no deepcopy: cloned, as values
        for value in vars(m).values():
            for t in (value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple))
                      else (value,)):
                if isinstance(t, torch.Tensor) and not t.is_leaf and id(t) not in memo:
                    memo[id(t)] = t.detach().clone()
    twin = copy.deepcopy(region, memo)
    for rel, m in twin.named_modules():
        for hook_id in added_hooks.get(rel, ()):
            for hooks in (m._forward_pre_hooks, m._forward_hooks, m._forward_pre_hooks_with_kwargs,
                          m._forward_hooks_with_kwargs, m._forward_hooks_always_called):
                hooks.pop(hook_id, None)
        if PLACEMENTS_ATTR in vars(m):
            delattr(m, PLACEMENTS_ATTR)
        if getattr(getattr(vars(m).get("forward"), "__func__", None), LEAF_FORWARD, False):
            leaves_at_tp1(m, rel)  # (tp_invariant's leaf by leaf run, as at TP 1)
        for attr, value in originals.get(rel, {}).items():
            now = m._buffers[attr] if attr in m._buffers else vars(m).get(attr, value)
            if isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor):
                setattr(m, attr, _whole(now, value, group))  # (a cut cache: its whole value now, not at parallelize)
            elif not _same(now, value):
                setattr(m, attr, value)  # (an object the plan replaced: the original itself, read only)
    for p in twin.parameters():
        p.grad = None
    return twin


def _whole(now: torch.Tensor, original: torch.Tensor, group: Optional[TPGroup]) -> torch.Tensor:
    """The dense value of a tensor attribute or buffer the plan changed: where it was cut along one dim (``'k_cache:1'``),
    every rank's part as it is now, gathered (what forwards since wrote in it included); else a copy of the
    original (the twin writes to its own)."""
    if group is not None and now.dim() == original.dim():
        cut = [d for d in range(now.dim()) if now.shape[d] != original.shape[d]]
        pieces = original.shape[cut[0]] // now.shape[cut[0]] if len(cut) == 1 and now.shape[cut[0]] else 0
        if pieces and pieces * now.shape[cut[0]] == original.shape[cut[0]] and group.size % pieces == 0:
            whole = all_gather_tensor(now.detach().contiguous(), cut[0], group=group)
            if pieces == group.size:
                return whole
            # (KV heads fewer than ranks, 'k_cache:2:kv': each piece held by p / pieces ranks; the first's)
            return torch.cat(whole.chunk(group.size, cut[0])[::group.size // pieces], cut[0])
    return original.detach().clone()


def _same(a: Any, b: Any) -> bool:
    """``a`` is ``b``, or an equal value of the same type (tensors: identity only)."""
    if a is b:
        return True
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an __eq__ that cannot answer: not the same
        return False


def relative_error(actual: Optional[torch.Tensor], expected: Optional[torch.Tensor], floor: float = 0.0) -> float:
    """max|actual - expected| / max(max|actual|, max|expected|, floor). ``floor``: below it a tensor is
    noise (the gradient of a key bias, zero in exact arithmetic, is ~1e-17 on both sides and differs).
    Non-finite values match only the same non-finite value at the same place (NaN with NaN, +inf with +inf:
    inputs that carry them on every rank are the data's, not the plan's); anywhere else, ``inf``."""
    if actual is None and expected is None:
        return 0.0
    if actual is None or expected is None:
        other = (expected if actual is None else actual).detach()
        scale = float(other.abs().max()) if other.numel() else 0.0
        return 0.0 if scale == 0.0 else scale / max(scale, floor)
    if actual.shape != expected.shape:
        return float("inf")
    dtype = torch.promote_types(torch.promote_types(actual.dtype, expected.dtype), torch.float32)
    a, e = actual.detach().to(dtype), expected.detach().to(dtype)  # no copy for float32 / float64
    finite = torch.isfinite(a)
    if not bool(finite.all()) or not bool(torch.isfinite(e).all()):  # non-finite values compared as such
        same = (finite == torch.isfinite(e)) & (finite | (a == e) | (a.isnan() & e.isnan()))
        if not bool(same.all()):
            return float("inf")  # a NaN or an infinity on one side only, or infinities of opposite signs
        a, e = a[finite], e[finite]  # the rest compared as usual
    scale = max(float(torch.maximum(a.abs().max(), e.abs().max())) if a.numel() else 0.0, floor)
    if scale == 0.0:
        return 0.0
    return float((a - e).abs().max().nan_to_num(nan=float("inf"))) / scale


def scale_of(t: Optional[torch.Tensor]) -> float:
    return float(t.detach().abs().max()) if t is not None and t.numel() else 0.0
