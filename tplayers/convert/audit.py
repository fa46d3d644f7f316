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
  relative to the dense tensor's scale, with a tolerance set by the dtype (``tp_invariant=True``: the twin is
  the region at TP 1 on the same fixed-tree path, the tolerance 0). Both run in eval mode
  (dropout off) under a forked RNG, so the training run's random stream is not changed.
- Any mismatch (or a TP region that raises where the dense twin does not) raises
  :class:`AuditError` on every rank, before the optimizer can step, naming the region, the worst
  tensor against its tolerance and the likely cause. A replicated parameter whose gradient is proven
  a partial sum (its sum over the ranks is the dense gradient) gets the plan line that fixes it.
  Every later forward through that region raises the same error (a caught error does not train on).
- Every collective it issues is issued by every rank in the same order (to_dense, the gathers, one
  all-gather of the verdict): it cannot hang where the model's own forward would not.

Cost: one extra forward and backward of one instance per distinct region, at the first step, and
that region's dense weights and activations while it runs; nothing afterwards. The twin and the
copied runs are in :mod:`tplayers.convert.twin`, one region's check in :mod:`tplayers.convert.audit_region`,
the likely causes in :mod:`tplayers.convert.causes`.
``parallelize(..., audit=False)`` turns it off; :func:`audit` runs it on demand.
"""
from __future__ import annotations

import fnmatch
import re
import weakref
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn

from ..core.groups import TPGroup
from ..layers.base import model_placements
from ..layers.same_inputs import in_pipeline_shape_inference
from .audit_region import AuditError, Region, RegionAudit, check_region
from .twin import Kept, forked_rng, within

__all__ = ["AuditReport", "Auditor", "audit", "find_regions", "AUDIT_ATTR"]

AUDIT_ATTR = "_tplayers_auditor"

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


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def find_regions(io: Dict[str, Tuple[bool, bool]], reduce_grad: Sequence[str], alone: Sequence[str] = ()) -> List[str]:
    """Region module names from each converted module's ``(input split, output split)``.

    A row layer (split input) belongs to its closest ancestor that also holds a column layer (split
    output), and a column layer to its closest ancestor holding a row layer. A layer with no partner
    (whole on both sides) and the layers in ``alone`` (a vocabulary-split head, whose logits shard the user's
    loss consumes: its output compared as a shard) are regions alone; a module whose replicated parameters
    see split activations (``reduce_grad``) is inside one of those or its parent is. Regions inside another
    are dropped."""
    split_in = [n for n, (i, _) in io.items() if i]
    split_out = [n for n, (_, o) in io.items() if o and n not in alone]
    found: Set[str] = set(alone)

    def climb(start: str, targets: List[str]) -> str:
        a = _parent(start)
        while True:
            if any(within(t, a) and t != start for t in targets):
                return a
            if not a:
                return start  # no partner anywhere: the layer alone
            a = _parent(a)

    for r in split_in:
        found.add(climb(r, split_out))
    for c in split_out:
        if not any(within(c, f) for f in found):
            found.add(climb(c, split_in))
    for n, (i, o) in io.items():
        if not i and not o and not any(within(n, f) for f in found):
            found.add(n)
    for n in reduce_grad:
        if not any(within(n, f) for f in found):
            found.add(_parent(n))
    return sorted(f for f in found if not any(g != f and within(f, g) for g in found))


def _simple_attrs(module: nn.Module) -> Dict[str, Any]:
    return {k: v for k, v in vars(module).items() if type(v) in (int, float, bool) and k != "training"}


def _hook_ids(module: nn.Module) -> Set[int]:
    return set(module._forward_pre_hooks) | set(module._forward_hooks)


class Auditor:
    """The regions of one ``parallelize`` call and their audit state (stored on the model)."""

    def __init__(self, model: nn.Module, names: List[str], tp: TPGroup, plan_name: str,
                 io: Dict[str, Tuple[bool, bool]], sequence_marks: Dict[str, str]) -> None:
        modules = dict(model.named_modules())
        self.group, self.plan_name = tp, plan_name
        self.root = weakref.ref(model)  # (the model holds its auditor)
        self.eager_pass = False  # the eager forward run before torch.compile traces the first call

        def marked(region: str, mark: str) -> bool:
            return any(within(n, region) for n, m in sequence_marks.items() if m == mark)
        self.regions = [Region(n, modules[n], {rel: _simple_attrs(m) for rel, m in modules[n].named_modules()},
                                split=io.get(n, (False, False)), enters_sequence=marked(n, "enter_sequence"),
                                leaves_sequence=marked(n, "leave_sequence")) for n in names]
        self._hooks_before: Dict[int, Set[int]] = {}
        self.handles: List[Any] = []
        self.report: Optional[AuditReport] = None
        self.results: Dict[Tuple, RegionAudit] = {}
        self.active = False
        self.on_demand = False  # tplayers.audit: check even where the model's forward turns autograd off
        self.skipped: Tuple[str, ...] = ()  # parallelize(..., audit_skip=...)

    # -- parallelize's steps ---------------------------------------------------------------------
    def record_originals(self, changed: List[Tuple[nn.Module, str, Any]]) -> None:
        """The value, of any type, of every attribute the plan is about to set (``set_attrs``, ``divide_attrs``:
        a per-layer config copy, a tuple of widths), for the dense twin (before: only ints, floats and bools
        were kept, and a twin reading a replaced config object split its dense output with the TP sizes)."""
        for region in self.regions:
            where = {id(m): rel for rel, m in region.module.named_modules()}
            for module, attr, value in changed:
                if id(module) in where:
                    region.originals.setdefault(where[id(module)], {})[attr] = value

    def before_hooks(self, model: nn.Module) -> None:
        self._hooks_before = {id(m): _hook_ids(m) for m in model.modules()}

    def after_swap(self, model: nn.Module) -> None:
        """The swapped-in modules, the hooks parallelize added, each region's structure."""
        modules = dict(model.named_modules())
        groups: Dict[Tuple, List[Region]] = {}
        for region in self.regions:
            region.module = modules[region.name]
            region.added_hooks = {rel: _hook_ids(m) - self._hooks_before.get(id(m), set())
                                  for rel, m in region.module.named_modules()}
            region.signature = _signature(region.module)
            groups.setdefault(region.signature, []).append(region)
        self._hooks_before = {}
        self.results = {sig: RegionAudit(rs[0].name, type(rs[0].module).__name__, len(rs)) for sig, rs in groups.items()}
        self.report = AuditReport(list(self.results.values()))

    def skip(self, patterns: Sequence[str]) -> None:
        """``parallelize(..., audit_skip=patterns)``: the regions whose names match, and every region like each,
        left out of the audit by the user's choice. A pattern that matches no region is refused (a typo would
        otherwise leave the region audited, or a refusal in place, without a word)."""
        if isinstance(patterns, str):
            patterns = (patterns,)
        self.skipped = tuple(patterns)
        for pat in patterns:
            hit = [r for r in self.regions if fnmatch.fnmatchcase(r.name, pat)]
            if not hit:
                raise ValueError(f"parallelize(..., audit_skip={list(patterns)!r}): '{pat}' matches no audited region "
                                 f"(regions: {sorted({r.name for r in self.regions})[:8]})")
            for region in hit:
                result = self.results[region.signature]
                result.status = "skipped"
                result.reason = f"audit_skip={pat!r}: left out by your choice, it trains unchecked"

    def arm(self) -> None:
        """Install the first-call hooks on every instance of each region not audited yet."""
        self.disarm()
        for region in self.regions:
            if self.results[region.signature].status not in ("pending", "failed"):
                continue
            hook = self._hook(region)
            self.handles.append(region.module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
            region.added_hooks.setdefault("", set()).add(self.handles[-1].id)
        root = self.root()
        if self.handles and root is not None:  # (compiler.disable: dynamo starts at the first frame outside torch,
            # so the hook must be one it runs eagerly; wrapped here, not at import: it imports torch._dynamo)
            hook = torch.compiler.disable(self._before_compiled_trace)
            self.handles.append(root.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
            for region in self.regions:
                if region.name == "":  # (the twin of a whole-model region runs without it)
                    region.added_hooks.setdefault("", set()).add(self.handles[-1].id)

    def disarm(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def rearm(self) -> None:
        for result in self.results.values():
            result.status, result.errors, result.reason, result.note, result.message = "pending", {}, "", "", ""
        self.skip(self.skipped)
        self.arm()

    def _before_compiled_trace(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """The root's pre-hook. ``torch.compile(model)`` runs the root's own hooks eagerly and traces from its
        forward, where the regions' first-call hooks cannot run the audit (``fullgraph=True`` would fail on the
        graph break, and the audit's error would reach the user as dynamo's "Observed exception"). So the first
        compiled call that would audit runs one eager forward of the model on its inputs first, every region
        audited in it, with the model's buffers, attributes and random stream put back after; once all passed the
        hooks are gone and dynamo traces the forward without them. An AuditError is raised here, as in eager."""
        in_compiled = getattr(torch._dynamo.eval_frame, "_is_in_optimized_module", lambda: False)
        if self.active or self.eager_pass or not torch.is_grad_enabled() or not in_compiled():
            return
        self._audit_eagerly(model, args, kwargs)

    def _audit_eagerly(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        self.eager_pass = True
        try:
            with Kept(model), forked_rng():
                model(*args, **kwargs)  # (its output and graph dropped)
        finally:
            self.eager_pass = False

    def _hook(self, region: Region) -> Any:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            result = self.results[region.signature]
            if result.status == "failed" and not self.active:  # a model known to be wrong stays stopped
                raise AuditError(result.message)
            if result.status != "pending" or self.active or not (torch.is_grad_enabled() or self.on_demand):
                return  # a forward under no_grad (generate, evaluation) waits for the first training step
            if torch.compiler.is_compiling():
                raise AuditError(f"tplayers audit: region '{region.name}' is reached first inside torch.compile: run "
                                 "one eager forward first, or tplayers.audit(model, *example_inputs) before compiling, "
                                 "or parallelize(..., audit=False)")
            if in_pipeline_shape_inference():
                return  # PipelineStage's shape inference, on uninitialized activations: the next call is judged
            self.active = True
            try:  # the instance called (a deep copy of the model calls its own modules)
                with torch.inference_mode(False), torch.enable_grad():  # (a forward under inference_mode, on demand)
                    check_region(replace(region, module=module), result, self.group, args, kwargs, self.plan_name)
            finally:
                self.active = False
                if all(r.status in ("passed", "skipped") for r in self.results.values()):
                    self.disarm()  # (a failed region keeps its hook: every later forward raises again)
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
# the public entry point


def audit(model: nn.Module, *args: Any, **kwargs: Any) -> AuditReport:
    """Run the audit now: ``model(*args, **kwargs)`` once (with autograd on, no backward), auditing each
    distinct region at its first call (also inside a forward that turns autograd off itself, as Meta's Llama
    reference does with ``@torch.inference_mode()``: the regions are checked with autograd on); returns the :class:`AuditReport` or raises
    :class:`AuditError` on every rank. Collective: call on every rank of the TP group with the
    same inputs. Also after ``parallelize(..., audit=False)`` (e.g. eagerly, before torch.compile)."""
    auditor = getattr(model, AUDIT_ATTR, None)
    if auditor is None:
        raise ValueError(f"tplayers.audit: {type(model).__name__} was not parallelized (no regions recorded); call "
                         "tplayers.parallelize(model, plan, group=...) first")
    auditor.rearm()
    auditor.on_demand = True  # also where the model's forward turns autograd off (Meta's @torch.inference_mode())
    try:
        with torch.enable_grad():  # as a training step's forward (hooks may depend on it); no backward
            model(*args, **kwargs)
    finally:
        auditor.on_demand = False
        auditor.disarm()
    for result in auditor.results.values():
        if result.status == "pending":
            result.status, result.reason = "skipped", "not reached by this forward"
    return auditor.report
