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
  Every later forward through that region raises the same error (a caught error does not train on).
- Every collective it issues is issued by every rank in the same order (to_dense, the gathers, one
  all-gather of the verdict): it cannot hang where the model's own forward would not.

Cost: one extra forward and backward of one instance per distinct region, at the first step, and
that region's dense weights and activations while it runs; nothing afterwards. The twin and the
copied runs are in :mod:`tplayers.convert.twin`, the likely causes in :mod:`tplayers.convert.causes`.
``parallelize(..., audit=False)`` turns it off; :func:`audit` runs it on demand.
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn

from ..core.collectives import all_gather_tensor, all_gather_text, all_reduce_tensor
from ..core.groups import TPGroup
from ..core.placement import Sharded
from ..layers.base import model_placements
from ..layers.dense_view import dense_tensors
from .causes import likely_causes
from .twin import (Quiet, copy_inputs, dense_twin, float32_copy, gather_first, random_like, relative_error, run_region,
                   scale_of, within)

__all__ = ["AuditError", "AuditReport", "RegionAudit", "audit", "relative_tolerance", "AUDIT_ATTR"]

AUDIT_ATTR = "_tplayers_auditor"

# Largest allowed max|tp - dense| / scale per parameter dtype. TP only reorders sums, so a float64 model
# agrees to ~1e-15 where it computes in float64, but Hugging Face norms compute in float32 whatever the
# weights (measured 1e-7 at TP 4: Qwen3, Gemma3), hence 1e-6; float32 agrees to ~1e-6; bfloat16 rounds
# every partial sum to 8 bits. A wrong plan is off by 1e-3 .. O(1) (a partial gradient at TP 2 misses
# about half of it), above every entry.
_RELATIVE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


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
    reason: str = ""  # why skipped, or the failure's first line
    message: str = ""  # a failure's whole error, raised again by every later forward through the region
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
        self.tp, self.plan_name = tp, plan_name

        def marked(region: str, mark: str) -> bool:
            return any(within(n, region) for n, m in sequence_marks.items() if m == mark)
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
            if self.results[region.signature].status not in ("pending", "failed"):
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
            result.status, result.errors, result.reason, result.note, result.message = "pending", {}, "", "", ""
        self.arm()

    def _hook(self, region: _Region) -> Any:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            result = self.results[region.signature]
            if result.status == "failed" and not self.active:  # a model known to be wrong stays stopped
                raise AuditError(result.message)
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
# one region's audit


# Where tplayers refuses the input a user fed (ids out of range, a sequence length that does not divide):
# the forward would raise the same error with its own message, so the audit lets it through as it is.
_INPUT_CHECKS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), *f)
                      for f in (("core", "validate.py"), ("convert", "sequence.py")))


def _refused_by_tplayers(e: BaseException) -> bool:
    """An input refusal raised by tplayers itself (see ``_INPUT_CHECKS``); any other error of a sharded
    run (a tplayers layer handed a tensor of the wrong width included) is the audit's to explain."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = os.path.abspath(tb.tb_frame.f_code.co_filename) if tb is not None else ""
    return isinstance(e, (ValueError, IndexError)) and where in _INPUT_CHECKS


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
        module, cast = float32_copy(module), torch.float32
        region = replace(region, module=module)
        result.note = f"audited in float32 (the model is {str(dtype).replace('torch.', '')})"
    tol = result.tolerance = relative_tolerance(cast or dtype)
    failure, tp_error = "", None
    with Quiet(module):
        a1, k1, diff1 = copy_inputs(args, kwargs, cast)
        a2, k2, diff2 = copy_inputs(args, kwargs, cast)
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
                return random_like(out.shape, out)
            padded.append(out.shape[out_dim] * tp.size)
            full = list(out.shape)
            full[out_dim] = padded[0]
            return random_like(full, out).chunk(tp.size, dim=out_dim)[tp.rank].contiguous()

        def dense_grad(out: torch.Tensor) -> torch.Tensor:
            out_dim = dims[1]
            if out_dim is None:
                return random_like(out.shape, out)
            full = list(out.shape)
            full[out_dim] = max(padded[0], out.shape[out_dim])
            return random_like(full, out).narrow(out_dim, 0, out.shape[out_dim])
        try:
            tp_out, tp_in_grads, tp_grads = run_region(module, a1, k1, diff1, tp_grad)
        except Exception as e:  # noqa: BLE001 - re-raised below with the dense twin's verdict
            if _refused_by_tplayers(e):  # a check of tplayers' own refused this input: its message says why
                raise
            tp_error, padded = e, padded or [0]
        # every rank learns whether any rank's sharded run raised, before the collectives below
        raised = all_gather_text("" if tp_error is None else f"{type(tp_error).__name__}: {tp_error}", group=tp)
        failed_on = next((r for r, m in enumerate(raised) if m), None)
        in_dim, out_dim = split_dims()
        if in_dim is not None:  # the dense twin takes the whole input
            a2, k2, diff2 = gather_first(a2, k2, tp, in_dim)
        try:
            twin = dense_twin(region.module, region.originals, region.added_hooks)
            with Quiet(twin):
                dense_out, dense_in_grads, dense_grads = run_region(twin, a2, k2, diff2, dense_grad)
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
                       + likely_causes(region.name, region.module, region.originals, tp.size, True, []))
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
    result.message = (f"tplayers audit (plan '{plan_name}', TP {tp.size}, rank {rank}): {where} does not compute what "
                      f"its dense twin computes: {message}\nThe forward stopped before any optimizer step. Fix the plan "
                      "(docs/models.md, 'Plans for your own model'), or parallelize(..., audit=False) to skip the audit.")
    raise AuditError(result.message)


def _compare(region: _Region, result: RegionAudit, tp: TPGroup, tol: float, tp_run: tuple, dense_run: tuple,
             plan_name: str) -> str:
    """Compare both runs (every rank issues the same collectives); the failure text, or ''."""
    tp_out, tp_in_grads, tp_grads = tp_run
    dense_out, dense_in_grads, dense_grads, twin = dense_run
    module = region.module
    errors = result.errors
    errors["output"] = relative_error(tp_out, dense_out)
    for i, (a, e) in enumerate(zip(tp_in_grads, dense_in_grads)):
        errors[f"input gradient {i}"] = relative_error(a, e)
    tp_dense = dense_tensors(module, lambda name, p: tp_grads.get(id(p)))  # sharded gathered: collective
    twin_dense = {n: dense_grads.get(id(p)) for n, p in twin.named_parameters()}
    # a parameter gradient below tol x the region's largest one is noise at this precision
    floor = tol * max([scale_of(g) for g in twin_dense.values()] + [0.0])
    for name in sorted(set(tp_dense) & set(twin_dense)):
        errors[f"gradient of '{name}'"] = relative_error(tp_dense[name], twin_dense[name], floor)
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
               and relative_error(s, twin_dense[n], floor) <= tol]
    forward_wrong = not errors["output"] <= tol
    return "\n".join(lines) + "\n" + likely_causes(region.name, module, region.originals, tp.size, forward_wrong, partial, plan_name)


def _sum_over_ranks(tensors: List[torch.Tensor], tp: TPGroup) -> List[torch.Tensor]:
    if not tensors or tp.size == 1:
        return list(tensors)
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    total = all_reduce_tensor(flat, group=tp)  # one all-reduce for every replicated gradient of the region
    out, start = [], 0
    for t in tensors:
        out.append(total[start:start + t.numel()].view(t.shape).to(t.dtype))
        start += t.numel()
    return out


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
