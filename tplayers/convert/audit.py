"""The audit: ``parallelize`` proves, on the user's own model, that each converted region computes
what its dense twin computes, or raises an error naming the fault, on every rank.

A plan is data about code tplayers has never read: a fused q/k/v declared ``"column"``, a head count
the forward reads but the plan does not divide, a replicated parameter acting on split activations
(its gradient a partial sum), per-head modules indexed from 0 on every rank. Each gives a model that
runs, and trains wrong. So the first forward after ``parallelize`` checks it:

- A **region** is the smallest module whose input and output are whole on every rank around each
  column -> row pair (an attention, an MLP), or a TP layer that is whole on both sides on its own
  (the embedding, the LM head). Regions of the same structure (every decoder layer's attention) are
  audited once, on the first instance the forward reaches.
- At that instance's first call with autograd on (a forward pre-hook; forwards under ``no_grad``,
  such as ``generate``, wait for the first training step), before the forward goes on: its inputs are
  copied (tensors detached, caches deep-copied, so the real forward is untouched); the TP region runs
  forward and backward on them (``autograd.grad``: no ``.grad`` written); its **dense twin** (a copy
  of the region with every TP layer replaced by its ``to_dense()``, the attributes ``parallelize``
  or the user changed since restored, and the hooks ``parallelize`` added removed) runs the same; the
  output, every input gradient and every parameter gradient (sharded ones gathered) are compared,
  relative to the dense tensor's scale, with a tolerance set by the dtype. Both run in eval mode
  (dropout off) under a forked RNG, so the training run's random stream is not changed.
- Any mismatch (or a TP region that raises where the dense twin does not) raises
  :class:`AuditError` on every rank, before the optimizer can step, naming the region, the worst
  tensor against its tolerance and the likely cause. A replicated parameter whose gradient is proven
  a partial sum (its sum over the ranks is the dense gradient) gets the plan line that fixes it.
- Every collective it issues is issued by every rank in the same order (to_dense, the gathers, one
  all-gather of the verdict): it cannot hang where the model's own forward would not.

Cost: one extra forward and backward of one instance per distinct region, at the first step, and
that region's dense weights and activations while it runs; nothing afterwards.
``parallelize(..., audit=False)`` turns it off; :func:`audit` runs it on demand.
"""
from __future__ import annotations

import copy
import os
import re
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..core.collectives import all_gather_tensor, all_gather_text
from ..core.groups import TPGroup
from ..core.placement import Replicated, Sharded
from ..layers.base import PLACEMENTS_ATTR, TensorParallelModule, model_placements, placements_of
from ..layers.dense_view import dense_tensors
from ..layers.fused import FusedColumnParallelLinear
from ..layers.linear import ColumnParallelLinear

__all__ = ["AuditError", "AuditReport", "RegionAudit", "audit", "relative_tolerance", "AUDIT_ATTR"]

AUDIT_ATTR = "_tplayers_auditor"

# Largest allowed max|tp - dense| / scale per parameter dtype. TP only reorders sums, so a float64 model
# agrees to ~1e-15 where it computes in float64, but Hugging Face norms compute in float32 whatever the
# weights (measured 1e-7 at TP 4: Qwen3, Gemma3), hence 1e-6; float32 agrees to ~1e-6; bfloat16 rounds
# every partial sum to 8 bits. A wrong plan is off by 1e-3 .. O(1) (a partial gradient at TP 2 misses
# about half of it), above every entry.
_RELATIVE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}

# attribute names a forward may read as a head count or a width
_HEAD_ATTR = re.compile(r"(^|_)(n_?heads?|num_(attention_|key_value_|kv_)?heads|n_kv_heads?|n_local_heads|"
                        r"num_heads_per_partition|heads)$")
_WIDTH_ATTR = re.compile(r"^(n_embd|embed_dim|hidden_size|d_model|dim|n_state|all_head_size|inner_dim)$")
_MLP_NAMES = re.compile(r"(fc|mlp|ffn|up|gate|w1|w3|dense_h_to_4h|intermediate)", re.I)
_FUSED_NAMES = re.compile(r"(qkv|c_attn|query_key_value|wqkv|in_proj|gate_up|w13|w1_w3|fc_in_gate)", re.I)


class AuditError(RuntimeError):
    """A converted region does not compute what its dense twin computes (raised on every rank)."""


def relative_tolerance(dtype: torch.dtype) -> float:
    """The audit's tolerance for ``dtype``: max|tp - dense| / max|dense| must not exceed it."""
    return _RELATIVE_TOLERANCE.get(dtype, 1e-4)


@dataclass
class RegionAudit:
    """The audit of one distinct region (``instances``: modules of the same structure it stands for)."""

    name: str
    kind: str  # the region module's class
    instances: int
    status: str = "pending"  # "pending" (not reached yet), "passed", "failed", "skipped"
    errors: Dict[str, float] = field(default_factory=dict)  # what was compared -> max relative error
    tolerance: float = 0.0
    reason: str = ""  # why skipped, or the failure
    note: str = ""  # how it was audited, when not as the model runs

    @property
    def worst(self) -> Tuple[str, float]:
        return max(self.errors.items(), key=lambda kv: kv[1]) if self.errors else ("", 0.0)

    def __str__(self) -> str:
        head = f"{self.name} ({self.kind}" + (f", x{self.instances}" if self.instances > 1 else "") + ")"
        if self.status == "passed":
            what, err = self.worst
            margin = f"{self.tolerance / err:.0e}x below" if err > 0 else "exact"
            note = f"; {self.note}" if self.note else ""
            return f"{head}: passed; worst {what} {err:.1e} (tolerance {self.tolerance:g}: {margin}){note}"
        return f"{head}: {self.status}" + (f" ({self.reason})" if self.reason else "")


@dataclass
class AuditReport:
    """Every distinct region of a parallelized model and what its audit found."""

    regions: List[RegionAudit]

    @property
    def passed(self) -> bool:
        return all(r.status in ("passed", "skipped") for r in self.regions) and any(
            r.status == "passed" for r in self.regions)

    def __str__(self) -> str:
        done = sum(r.status == "passed" for r in self.regions)
        lines = [f"tplayers audit: {done} of {len(self.regions)} distinct regions checked against their dense twins"]
        return "\n".join(lines + [f"    {r}" for r in self.regions])


# ---------------------------------------------------------------------------------------------------
# finding the regions (at parallelize time, before the swap)


def _inside(name: str, ancestor: str) -> bool:
    return ancestor == "" or name == ancestor or name.startswith(ancestor + ".")


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def find_regions(io: Dict[str, Tuple[bool, bool]], reduce_grad: Sequence[str]) -> List[str]:
    """Region module names from each converted module's ``(input split, output split)``.

    A row layer (split input) belongs to its closest ancestor that also holds a column layer (split
    output), and a column layer to its closest ancestor holding a row layer. A layer with no partner
    (whole on both sides, or a column whose split output the user consumes, e.g. vocab-parallel logits
    for the loss) is a region alone; a module whose replicated parameters see split activations
    (``reduce_grad``) is inside one of those or its parent is. Regions inside another are dropped."""
    split_in = [n for n, (i, _) in io.items() if i]
    split_out = [n for n, (_, o) in io.items() if o]
    found: Set[str] = set()

    def climb(start: str, targets: List[str]) -> str:
        a = _parent(start)
        while True:
            if any(_inside(t, a) and t != start for t in targets):
                return a
            if not a:
                return start  # no partner anywhere: the layer alone
            a = _parent(a)

    for r in split_in:
        found.add(climb(r, split_out))
    for c in split_out:
        if not any(_inside(c, f) for f in found):
            found.add(climb(c, split_in))
    for n, (i, o) in io.items():
        if not i and not o and not any(_inside(n, f) for f in found):
            found.add(n)
    for n in reduce_grad:
        if not any(_inside(n, f) for f in found):
            found.add(_parent(n))
    return sorted(f for f in found if not any(g != f and _inside(f, g) for g in found))


def _simple_attrs(module: nn.Module) -> Dict[str, Any]:
    return {k: v for k, v in vars(module).items() if type(v) in (int, float, bool) and k != "training"}


def _hook_ids(module: nn.Module) -> Set[int]:
    return set(module._forward_pre_hooks) | set(module._forward_hooks)


@dataclass
class _Region:
    name: str
    module: nn.Module
    originals: Dict[str, Dict[str, Any]]  # relative module path -> its simple attributes before parallelize
    added_hooks: Dict[str, Set[int]] = field(default_factory=dict)  # relative path -> hook ids parallelize added
    signature: Tuple = ()
    split: Tuple[bool, bool] = (False, False)  # a layer alone: its input / output split on the last dim
    enters_sequence: bool = False  # under sequence parallelism: the region cuts its input along the sequence
    leaves_sequence: bool = False  # ... or gathers its output (so that side is whole)


class Auditor:
    """The regions of one ``parallelize`` call and their audit state (stored on the model)."""

    def __init__(self, model: nn.Module, names: List[str], tp: TPGroup, plan_name: str,
                 io: Dict[str, Tuple[bool, bool]], sequence_marks: Dict[str, str]) -> None:
        modules = dict(model.named_modules())
        self.tp, self.plan_name, self.model_name = tp, plan_name, type(model).__name__

        def marked(region: str, mark: str) -> bool:
            return any(_inside(n, region) for n, m in sequence_marks.items() if m == mark)
        self.regions = [_Region(n, modules[n], {rel: _simple_attrs(m) for rel, m in modules[n].named_modules()},
                                split=io.get(n, (False, False)), enters_sequence=marked(n, "enter_sequence"),
                                leaves_sequence=marked(n, "leave_sequence")) for n in names]
        self._hooks_before: Dict[int, Set[int]] = {}
        self.handles: List[Any] = []
        self.report: Optional[AuditReport] = None
        self.results: Dict[Tuple, RegionAudit] = {}
        self.active = False

    # -- parallelize's steps ---------------------------------------------------------------------
    def before_hooks(self, model: nn.Module) -> None:
        self._hooks_before = {id(m): _hook_ids(m) for m in model.modules()}

    def after_swap(self, model: nn.Module) -> None:
        """The swapped-in modules, the hooks parallelize added, each region's structure."""
        modules = dict(model.named_modules())
        groups: Dict[Tuple, List[_Region]] = {}
        for region in self.regions:
            region.module = modules[region.name]
            region.added_hooks = {rel: _hook_ids(m) - self._hooks_before.get(id(m), set())
                                  for rel, m in region.module.named_modules()}
            region.signature = _signature(region.module)
            groups.setdefault(region.signature, []).append(region)
        self._hooks_before = {}
        self.results = {sig: RegionAudit(rs[0].name, type(rs[0].module).__name__, len(rs)) for sig, rs in groups.items()}
        self.report = AuditReport(list(self.results.values()))

    def arm(self) -> None:
        """Install the first-call hooks on every instance of each region not audited yet."""
        self.disarm()
        for region in self.regions:
            if self.results[region.signature].status != "pending":
                continue
            hook = self._hook(region)
            self.handles.append(region.module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
            region.added_hooks.setdefault("", set()).add(self.handles[-1].id)

    def disarm(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def rearm(self) -> None:
        for result in self.results.values():
            result.status, result.errors, result.reason, result.note = "pending", {}, "", ""
        self.arm()

    def _hook(self, region: _Region) -> Any:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            result = self.results[region.signature]
            if result.status != "pending" or self.active or not torch.is_grad_enabled():
                return  # a forward under no_grad (generate, evaluation) waits for the first training step
            if torch.compiler.is_compiling():
                raise AuditError(f"tplayers audit: region '{region.name}' is reached first inside torch.compile: run "
                                 "one eager forward first, or tplayers.audit(model, *example_inputs) before compiling, "
                                 "or parallelize(..., audit=False)")
            self.active = True
            try:  # the instance called (a deep copy of the model calls its own modules)
                _audit_region(replace(region, module=module), result, self.tp, args, kwargs, self.plan_name)
            finally:
                self.active = False
                if all(r.status != "pending" for r in self.results.values()):
                    self.disarm()
        return pre_hook


# attributes that number a layer: every layer has its own value, which says nothing of what it computes
_POSITION_ATTR = re.compile(r"(idx|index|layer_id|layer_num|layer_number)$")


def _behaviour(m: nn.Module) -> Tuple:
    """A module's plain attributes (Gemma2's ``layer_type`` / ``sliding_window``), its layer number left out."""
    return tuple(sorted((k, v) for k, v in vars(m).items() if type(v) in (int, float, bool, str, type(None))
                        and k != "training" and not k.startswith("_") and not _POSITION_ATTR.search(k)))


def _signature(module: nn.Module) -> Tuple:
    """What makes two regions the same: module classes, plain attributes, parameter shapes and
    placements, by path (Gemma2's sliding-window and global layers are two regions)."""
    placements = model_placements(module)
    return tuple((rel, type(m).__qualname__, _behaviour(m),
                  tuple((n, tuple(p.shape), repr(placements.get(f"{rel}.{n}" if rel else n)))
                        for n, p in m.named_parameters(recurse=False)))
                 for rel, m in module.named_modules())


# ---------------------------------------------------------------------------------------------------
# one region's audit


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


def _float32_copy(module: nn.Module) -> nn.Module:
    """A float32 copy of a TP region that still communicates over the same TP groups."""
    memo: Dict[int, Any] = {id(m.tp): m.tp for m in module.modules() if isinstance(getattr(m, "tp", None), TPGroup)}
    return copy.deepcopy(module, memo).float()


def _copy_inputs(args: tuple, kwargs: dict, cast: Optional[torch.dtype] = None
                 ) -> Tuple[tuple, dict, List[torch.Tensor]]:
    """Detached copies of the call's tensors (floating ones cast to ``cast`` if given; those that
    required grad, else the first floating one, become leaves that require grad), everything else
    deep-copied (caches are written to)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    floating = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    want = [i for i in floating if leaves[i].requires_grad] or floating[:1]
    memo: Dict[int, Any] = {}
    out, diff = [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().clone() if cast is None or not leaf.is_floating_point() else leaf.detach().to(cast)
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
                memo.setdefault(id(t), t.detach().clone() if cast is None or not t.is_floating_point()
                                else t.detach().to(cast))
            out[i] = copy.deepcopy(leaf, memo)
    a, k = pytree.tree_unflatten(out, spec)
    return a, k, diff


def _gather_first(args: tuple, kwargs: dict, tp: TPGroup, dim: int) -> Tuple[tuple, dict, List[torch.Tensor]]:
    """The call with its first floating tensor all-gathered along ``dim`` (a leaf requiring grad)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    i = next(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point())
    leaves[i] = all_gather_tensor(leaves[i].detach().contiguous(), dim, group=tp).requires_grad_(True)
    diff = [leaves[i]] + [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and t is not leaves[i]]
    a, k = pytree.tree_unflatten(leaves, spec)
    return a, k, diff


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _refused_by_tplayers(e: BaseException) -> bool:
    """An input error raised by tplayers itself (a sequence length that does not divide, an id out of
    range): the forward would raise it anyway, with its own clear message."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = os.path.abspath(tb.tb_frame.f_code.co_filename) if tb is not None else ""
    return isinstance(e, (ValueError, IndexError, TypeError)) and where.startswith(_PACKAGE + os.sep) \
        and where != os.path.abspath(__file__)


def _first_float(tree: Any) -> Optional[torch.Tensor]:
    return next((t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


class _Quiet:
    """Eval mode, no delayed weight gradients or main_grad accumulation, a forked RNG, autocast off:
    the audit's runs leave the model, its buffers and the training's random stream as they were."""

    def __init__(self, *modules: nn.Module) -> None:
        self.modules = modules

    def __enter__(self) -> "_Quiet":
        self.saved = []
        for root in self.modules:
            for m in root.modules():
                self.saved.append((m, "training", m.training))
                for attr in ("delay_wgrad", "accumulate_main_grad"):
                    if isinstance(getattr(m, attr, None), bool):
                        self.saved.append((m, attr, getattr(m, attr)))
                        setattr(m, attr, False)
                m.training = False
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        self.rng = torch.random.fork_rng(devices=devices)
        self.rng.__enter__()
        self.grad = torch.enable_grad()
        self.grad.__enter__()
        # autocast off: a plan's faults do not depend on the precision, and mixed-precision rounding
        # would hide them under a loose tolerance (the region runs in its parameters' dtype)
        self.autocast = [torch.autocast(d, enabled=False) for d in ("cpu", "cuda")
                         if d == "cpu" or torch.cuda.is_available()]
        for a in self.autocast:
            a.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for a in reversed(self.autocast):
            a.__exit__(*exc)
        self.grad.__exit__(*exc)
        self.rng.__exit__(*exc)
        for m, attr, value in self.saved:
            setattr(m, attr, value)


def _run(module: nn.Module, args: tuple, kwargs: dict, diff: List[torch.Tensor], grad_for: Any
         ) -> Tuple[torch.Tensor, List[Optional[torch.Tensor]], Dict[int, Optional[torch.Tensor]]]:
    """Forward, then backward of ``grad_for(output)``: (output, input grads, {id(param): grad})."""
    out = _first_float(module(*args, **kwargs))
    if out is None:
        raise TypeError("its output holds no floating-point tensor to compare")
    params = [p for p in module.parameters() if p.requires_grad]
    targets = list(diff) + params
    grads = torch.autograd.grad([out], targets, [grad_for(out)], allow_unused=True) if out.requires_grad and targets \
        else [None] * len(targets)
    return out.detach(), list(grads[:len(diff)]), {id(p): g for p, g in zip(params, grads[len(diff):])}


def _random_like(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """The output gradient both runs backpropagate: the same on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(tuple(shape), generator=gen, dtype=like.dtype).to(like.device)


def _dense_twin(region: _Region) -> nn.Module:
    """The region with every TP layer replaced by its ``to_dense()`` (collective, in module order),
    its attributes as they were before ``parallelize`` and without the hooks ``parallelize`` added."""
    memo: Dict[int, Any] = {}
    outer: List[str] = []
    for rel, m in region.module.named_modules():
        if isinstance(m, TensorParallelModule) and not any(_inside(rel, o) for o in outer):
            outer.append(rel)
            memo[id(m)] = m.to_dense()
    if "" in outer:
        return memo[id(region.module)]
    twin = copy.deepcopy(region.module, memo)
    for rel, m in twin.named_modules():
        for hook_id in region.added_hooks.get(rel, ()):
            for hooks in (m._forward_pre_hooks, m._forward_hooks, m._forward_pre_hooks_with_kwargs,
                          m._forward_hooks_with_kwargs, m._forward_hooks_always_called):
                hooks.pop(hook_id, None)
        if PLACEMENTS_ATTR in vars(m):
            delattr(m, PLACEMENTS_ATTR)
        for attr, value in region.originals.get(rel, {}).items():
            if attr in vars(m) and vars(m)[attr] != value:
                setattr(m, attr, value)
    for p in twin.parameters():
        p.grad = None
    return twin


def _relative_error(actual: Optional[torch.Tensor], expected: Optional[torch.Tensor], floor: float = 0.0) -> float:
    """max|actual - expected| / max(max|actual|, max|expected|, floor). ``floor``: below it a tensor is
    noise (the gradient of a key bias, zero in exact arithmetic, is ~1e-17 on both sides and differs)."""
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
    scale = max(float(torch.maximum(a.abs().max(), e.abs().max())) if a.numel() else 0.0, floor)
    if scale == 0.0:
        return 0.0
    return float((a - e).abs().max().nan_to_num(nan=float("inf"))) / scale


def _scale(t: Optional[torch.Tensor]) -> float:
    return float(t.detach().abs().max()) if t is not None and t.numel() else 0.0


def _audit_region(region: _Region, result: RegionAudit, tp: TPGroup, args: tuple, kwargs: dict,
                  plan_name: str) -> None:
    module = region.module
    if any(t.device.type == "meta" for t in list(module.parameters()) + list(module.buffers())):
        result.status, result.reason = "skipped", "its weights are on the meta device"
        return
    if any(type(p).__name__ == "DTensor" for p in module.parameters()):
        result.status = "skipped"
        result.reason = "its parameters are DTensors (FSDP2 / DTensor): run tplayers.audit(model, *inputs) before fully_shard"
        warnings.warn(f"tplayers audit: region '{region.name}' not audited: {result.reason}", stacklevel=4)
        return
    if any(getattr(m, "sequence_parallel", False) for m in module.modules()) and any(region.split):
        result.status, result.reason = "skipped", "a sequence-parallel layer alone"
        return
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    cast: Optional[torch.dtype] = None
    if dtype in (torch.bfloat16, torch.float16):
        # A plan's faults do not depend on the precision, but 8-bit rounding through a ReLU or a softmax
        # moves gradients by ~20% (measured: OPT's fc1 in bfloat16, TP vs dense): audit a float32 copy
        # of the region (its TP groups shared), where TP and dense agree to ~1e-6.
        module, cast = _float32_copy(module), torch.float32
        region = replace(region, module=module)
        result.note = f"audited in float32 (the model is {str(dtype).replace('torch.', '')})"
    tol = result.tolerance = relative_tolerance(cast or dtype)
    failure, tp_error = "", None
    with _Quiet(module):
        a1, k1, diff1 = _copy_inputs(args, kwargs, cast)
        a2, k2, diff2 = _copy_inputs(args, kwargs, cast)
        padded: List[int] = []  # a split output's full size, every rank's shards side by side (padding included)
        dims: List[Optional[int]] = []  # (input dim, output dim) split on this rank, once the TP forward ran

        def split_dims() -> List[Optional[int]]:
            # Which side of the region is split, along which dim: a layer alone on the last dim (its partner
            # is the user's code); a region running sequence-parallel takes and gives (b, s/p, h), unless it
            # enters or leaves the sequence-parallel stream. Read after the TP forward: the hook entering the
            # stream decides, per forward, whether it is on.
            if not dims:
                dims.extend([-1 if region.split[0] else None, -1 if region.split[1] else None])
                if any(getattr(m, "sequence_parallel", False) for m in module.modules()):
                    dims[:] = [None if region.enters_sequence else -2, None if region.leaves_sequence else -2]
            return dims

        def tp_grad(out: torch.Tensor) -> torch.Tensor:
            out_dim = split_dims()[1]
            if out_dim is None:
                return _random_like(out.shape, out)
            padded.append(out.shape[out_dim] * tp.size)
            full = list(out.shape)
            full[out_dim] = padded[0]
            return _random_like(full, out).chunk(tp.size, dim=out_dim)[tp.rank].contiguous()

        def dense_grad(out: torch.Tensor) -> torch.Tensor:
            out_dim = dims[1]
            if out_dim is None:
                return _random_like(out.shape, out)
            full = list(out.shape)
            full[out_dim] = max(padded[0], out.shape[out_dim])
            return _random_like(full, out).narrow(out_dim, 0, out.shape[out_dim])
        try:
            tp_out, tp_in_grads, tp_grads = _run(module, a1, k1, diff1, tp_grad)
        except Exception as e:  # noqa: BLE001 - re-raised below with the dense twin's verdict
            if _refused_by_tplayers(e):  # a check of tplayers' own refused this input: its message says why
                raise
            tp_error, padded = e, padded or [0]
        # every rank learns whether any rank's sharded run raised, before the collectives below
        raised = all_gather_text("" if tp_error is None else f"{type(tp_error).__name__}: {tp_error}", group=tp)
        failed_on = next((r for r, m in enumerate(raised) if m), None)
        in_dim, out_dim = split_dims()
        if in_dim is not None:  # the dense twin takes the whole input
            a2, k2, diff2 = _gather_first(a2, k2, tp, in_dim)
        try:
            twin = _dense_twin(region)
            with _Quiet(twin):
                dense_out, dense_in_grads, dense_grads = _run(twin, a2, k2, diff2, dense_grad)
        except Exception as e:  # noqa: BLE001 - no dense twin to compare with: say so, never pass silently
            result.status, result.reason = "skipped", f"its dense twin could not run ({type(e).__name__}: {e})"
            if failed_on is None:
                warnings.warn(f"tplayers audit: region '{region.name}' not audited: {result.reason}", stacklevel=4)
                return
            if tp_error is not None:  # dense and sharded both fail: the model's own error, as it is
                raise tp_error
            raise RuntimeError(f"tplayers audit: region '{region.name}' raised on rank {failed_on}: "
                               f"{raised[failed_on]}") from None
        if failed_on is not None:
            failure = (f"it raises when sharded but not dense (rank {failed_on}): {raised[failed_on]}\n"
                       + _hints(region, tp, True, []))
        else:
            if out_dim is not None:  # every rank's part of the output, gathered (vocabulary padding cut)
                tp_out = all_gather_tensor(tp_out.contiguous(), out_dim, group=tp)
                tp_out = tp_out.narrow(out_dim, 0, dense_out.shape[out_dim])
            if in_dim is not None:
                tp_in_grads = [all_gather_tensor(g.contiguous(), in_dim, group=tp) if g is not None and i == 0 else g
                               for i, g in enumerate(tp_in_grads)]
            failure = _compare(region, result, tp, tol, (tp_out, tp_in_grads, tp_grads),
                               (dense_out, dense_in_grads, dense_grads, twin), plan_name)
    messages = all_gather_text(failure, group=tp)
    first = next(((r, m) for r, m in enumerate(messages) if m), None)
    if first is None:
        result.status = "passed"
        return
    rank, message = first
    result.status, result.reason = "failed", message.split("\n", 1)[0]
    where = f"region '{region.name}' ({type(module).__name__}" + (
        f", audited for {result.instances} regions like it" if result.instances > 1 else "") + ")"
    raise AuditError(f"tplayers audit (plan '{plan_name}', TP {tp.size}, rank {rank}): {where} does not compute what "
                     f"its dense twin computes: {message}\nThe forward stopped before any optimizer step. Fix the plan "
                     "(docs/models.md, 'Plans for your own model'), or parallelize(..., audit=False) to skip the audit.")


def _compare(region: _Region, result: RegionAudit, tp: TPGroup, tol: float, tp_run: tuple, dense_run: tuple,
             plan_name: str) -> str:
    """Compare both runs (every rank issues the same collectives); the failure text, or ''."""
    tp_out, tp_in_grads, tp_grads = tp_run
    dense_out, dense_in_grads, dense_grads, twin = dense_run
    module = region.module
    errors = result.errors
    errors["output"] = _relative_error(tp_out, dense_out)
    for i, (a, e) in enumerate(zip(tp_in_grads, dense_in_grads)):
        errors[f"input gradient {i}"] = _relative_error(a, e)
    tp_dense = dense_tensors(module, lambda name, p: tp_grads.get(id(p)))  # sharded gathered: collective
    twin_dense = {n: dense_grads.get(id(p)) for n, p in twin.named_parameters()}
    # a parameter gradient below tol x the region's largest one is noise at this precision
    floor = tol * max([_scale(g) for g in twin_dense.values()] + [0.0])
    for name in sorted(set(tp_dense) & set(twin_dense)):
        errors[f"gradient of '{name}'"] = _relative_error(tp_dense[name], twin_dense[name], floor)
    placements = model_placements(module)
    replicated = [n for n in sorted(tp_dense) if n in twin_dense and not isinstance(placements.get(n), Sharded)]
    summed = _sum_over_ranks([tp_dense[n] for n in replicated], tp)  # one collective, on every rank
    names_differ = sorted(set(tp_dense) ^ set(twin_dense))
    bad = {k: v for k, v in errors.items() if not v <= tol}
    if not bad and not names_differ:
        return ""
    if names_differ:
        return f"parameter names differ between the TP region and its dense twin: {names_differ}"
    worst, err = max(bad.items(), key=lambda kv: kv[1])
    lines = [f"{worst}: max relative error {err:.2e} > tolerance {tol:g} ({len(bad)} of {len(errors)} tensors off: "
             + ", ".join(f"{k} {v:.1e}" for k, v in sorted(bad.items(), key=lambda kv: -kv[1])[:4]) + ")"]
    partial = [n for n, s in zip(replicated, summed) if f"gradient of '{n}'" in bad
               and _relative_error(s, twin_dense[n], floor) <= tol]
    forward_wrong = not errors["output"] <= tol
    return "\n".join(lines) + "\n" + _hints(region, tp, forward_wrong, partial, plan_name=plan_name)


def _sum_over_ranks(tensors: List[torch.Tensor], tp: TPGroup) -> List[torch.Tensor]:
    if not tensors or tp.size == 1:
        return list(tensors)
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    total = all_gather_tensor(flat[None], 0, group=tp).sum(0)
    out, start = [], 0
    for t in tensors:
        out.append(total[start:start + t.numel()].view(t.shape).to(t.dtype))
        start += t.numel()
    return out


# ---------------------------------------------------------------------------------------------------
# likely causes


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _partial_hints(region: _Region, p: int, partial: List[str], plan_name: str) -> List[str]:
    causes = []
    for n in partial:
        owner = n.rpartition(".")[0]
        qual = _pattern(f"{region.name}.{owner}" if owner else region.name)
        how = ("plan = tplayers.auto_plan(model).plan; plan.layers[...] = ...; tplayers.parallelize(model, plan, ...)"
               if plan_name == "auto" else "add it to your plan")
        causes.append(f"'{n}' is whole on every rank but acts on split activations: each rank's gradient is a partial "
                      f"sum, and its sum over the {p} ranks equals the dense gradient (checked). Fix: the plan line "
                      f"\"{qual}\": \"replicate_reduce_grad\" ({how})")
    return causes


def _likely(causes: List[str]) -> str:
    seen: List[str] = []
    for c in causes:
        if c not in seen:
            seen.append(c)
    return "likely cause" + ("s" if len(seen) > 1 else "") + ":\n  - " + "\n  - ".join(seen)


def _hints(region: _Region, tp: TPGroup, forward_wrong: bool, partial: List[str], plan_name: str = "") -> str:
    """The likely causes, read off the region's structure, most specific first. ``forward_wrong``: the
    output differs or the forward raised (a layout or a head count); else only gradients do (a
    replicated parameter's partial gradient)."""
    module, p = region.module, tp.size
    causes: List[str] = []
    if not forward_wrong:
        return _likely(causes + _partial_hints(region, p, partial, plan_name) or [
            "the forward matches but gradients do not, and no replicated parameter's gradient is a plain partial "
            "sum: a parameter or buffer the forward uses on this rank's shard only (check_replicas may tell)"])
    causes += _partial_hints(region, p, partial, plan_name)
    heads: Dict[str, int] = {}
    for rel, attrs in region.originals.items():
        for attr, value in attrs.items():
            if isinstance(value, int) and not isinstance(value, bool) and _HEAD_ATTR.search(attr):
                heads[f"{rel}.{attr}" if rel else attr] = value
    mods = dict(module.named_modules())
    # counts that cannot split first: they are the likelier cause when several head counts are undivided
    for path, dense_value in sorted(heads.items(), key=lambda kv: kv[1] % p == 0):
        rel, _, attr = path.rpartition(".")
        now = getattr(mods.get(rel), attr, None)
        where = _pattern(f"{region.name}.{rel}" if rel else region.name)
        if now == dense_value and dense_value % p:
            causes.append(f"head count '{path}' = {dense_value} does not divide by the TP degree {p}: if these are the "
                          f"K/V heads, split the K and V projections with KVColumn(kv_heads='{attr}') (each KV head "
                          f"held by whole ranks: {'p / kv_heads' if dense_value < p else 'kv_heads / p'} of them), or "
                          f"the fused projection with FusedQKV(heads=..., kv_heads='{attr}'); a plain 'column' cuts "
                          "through heads")
        elif now == dense_value:
            causes.append(f"head count '{path}' = {dense_value} is the dense count on every rank, but each rank holds "
                          f"1/{p} of the heads: divide it (Plan(divide_attrs={{'{where}': ('{attr}',)}}))")
        elif isinstance(now, int) and dense_value % p:
            causes.append(f"head count '{path}' was {dense_value} and is now {now} on this rank, but {dense_value} does "
                          f"not divide by the TP degree {p}: the heads cannot be split evenly")
        for child_rel, child in mods.items():
            if isinstance(child, nn.ModuleList) and len(child) == dense_value and dense_value > 1 and _inside(child_rel, rel):
                causes.append(f"'{child_rel}' holds {len(child)} modules, one per head ('{path}'), whole on every rank, "
                              f"while rank r computes heads r*{dense_value // p or 1}..: a forward indexing them from 0 "
                              "pairs them with the wrong heads; per-head modules cannot be split by a plan yet, "
                              "leave this attention out of the plan ('replicate')")
    placements = model_placements(module)
    for n, prm in module.named_parameters():
        if isinstance(placements.get(n), (Sharded,)) or prm.dim() < 2:
            continue
        if any(prm.shape[0] == v and v % p == 0 and v > 1 for v in heads.values()):
            causes.append(f"parameter '{n}' {tuple(prm.shape)} is whole on every rank, and its first dim is a head "
                          "count: it acts on heads this rank does not hold; it needs splitting by heads, which a "
                          "plan cannot express yet: leave this attention out of the plan ('replicate')")
    for rel, m in mods.items():
        if isinstance(m, ColumnParallelLinear) and not m.gather_output and not isinstance(m, FusedColumnParallelLinear):
            out_f, in_f = m.out_features, m.in_features
            leaf = rel.rpartition(".")[2]
            if _FUSED_NAMES.search(leaf) or (out_f == 3 * in_f and not _MLP_NAMES.search(leaf)):
                causes.append(f"'{rel}' ({in_f} -> {out_f}) looks fused ([q; k; v] or [gate; up]) but is split as one "
                              "block ('column'): rank 0 gets all of q and part of k. Use \"fused_qkv\", "
                              "Column(parts=[...]) or tplayers.convert.FusedQKV(heads=..., kv_heads=...)")
    for rel, attrs in region.originals.items():
        for attr, value in attrs.items():
            if isinstance(value, int) and _WIDTH_ATTR.match(attr):
                now = getattr(mods.get(rel), attr, None)
                if now == value:
                    causes.append(f"width '{(rel + '.') if rel else ''}{attr}' = {value} is the dense width on every "
                                  "rank; if the forward splits or reshapes the sharded projections with it (or with a "
                                  "width read from its input, B, T, C = x.size()), each rank needs its local width "
                                  f"{value // p if value % p == 0 else value / p}: divide it (divide_attrs) or compute "
                                  "it from the projection's output")
    if not causes:
        causes.append("no structural cause recognised: compare the region's forward with the plan (which tensors it "
                      "reshapes with dense sizes, which parameters act on split activations)")
    return _likely(causes)


# ---------------------------------------------------------------------------------------------------
# the public entry point


def audit(model: nn.Module, *args: Any, **kwargs: Any) -> AuditReport:
    """Run the audit now: ``model(*args, **kwargs)`` once (with autograd on, no backward), auditing each
    distinct region at its first call; returns the :class:`AuditReport` or raises
    :class:`AuditError` on every rank. Collective: call on every rank of the TP group with the
    same inputs. Also after ``parallelize(..., audit=False)`` (e.g. eagerly, before torch.compile)."""
    auditor = getattr(model, AUDIT_ATTR, None)
    if auditor is None:
        raise ValueError(f"tplayers.audit: {type(model).__name__} was not parallelized (no regions recorded); call "
                         "tplayers.parallelize(model, plan, group=...) first")
    auditor.rearm()
    try:
        with torch.enable_grad():  # as a training step's forward (hooks may depend on it); no backward
            model(*args, **kwargs)
    finally:
        auditor.disarm()
    for result in auditor.results.values():
        if result.status == "pending":
            result.status, result.reason = "skipped", "not reached by this forward"
    return auditor.report
