"""One region's audit: the TP region and its dense twin run on the same inputs, compared, a verdict on
every rank (:mod:`tplayers.convert.audit` finds the regions and calls :func:`check_region`)."""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from ..core.blocking import all_gather_tensor, all_gather_text, all_reduce_tensor
from ..core.groups import TPGroup
from ..core.fingerprint import RanksDiverged
from ..core.placement import Sharded
from ..layers.base import model_placements
from ..layers.dense_view import dense_tensors
from .causes import likely_causes, name_pattern
from ..core.digest import generator_states, set_generator_states
from .invariant import is_invariant
from .sequence import MARK
from .twin import (Kept, Quiet, copy_inputs, dense_twin, first_float, float32_copy, gather_first, random_like,
                   relative_error, run_region, scale_of)

__all__ = ["AuditError", "RegionAudit", "Region", "check_region", "relative_tolerance"]

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
class Region:
    """One region of a parallelized model, as the audit sees it."""

    name: str
    module: nn.Module
    originals: Dict[str, Dict[str, Any]]  # relative path -> its simple attributes, and any the plan set, before
    added_hooks: Dict[str, Set[int]] = field(default_factory=dict)  # relative path -> hook ids parallelize added
    signature: Tuple = ()
    split: Tuple[bool, bool] = (False, False)  # a layer alone: its input / output split on the last dim
    enters_sequence: bool = False  # under sequence parallelism: the region cuts its input along the sequence
    leaves_sequence: bool = False  # ... or gathers its output (so that side is whole)


# ---------------------------------------------------------------------------------------------------
# one region's audit


# Where tplayers refuses the input a user fed (ids out of range, a sequence length that does not divide):
# the forward would raise the same error with its own message, so the audit lets it through as it is.
# (A fused linear's input checks, in core/functional.py, are not among them: a tplayers layer handed a
# tensor of the wrong width is a plan fault the audit explains.)
_INPUT_CHECKS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), *f)
                      for f in (("core", "validate.py"), ("convert", "sequence.py"), ("layers", "same_inputs.py")))


def _refused_by_tplayers(e: BaseException) -> bool:
    """An input refusal raised by tplayers itself (see ``_INPUT_CHECKS``: inputs that differ across the ranks
    included), or ranks whose shared state drifted (``RanksDiverged``: the data's fault, not the plan's); any
    other error of a sharded run (a tplayers layer handed a tensor of the wrong width included) is the audit's
    to explain."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = os.path.abspath(tb.tb_frame.f_code.co_filename) if tb is not None else ""
    return isinstance(e, RanksDiverged) or isinstance(e, (ValueError, IndexError)) and where in _INPUT_CHECKS


def _skip_reason(region: Region) -> str:
    """Why this region cannot be audited as it is ('' when it can)."""
    module = region.module
    if any(t.device.type == "meta" for t in list(module.parameters()) + list(module.buffers())):
        return "its weights are on the meta device"
    if any(type(p).__name__ == "DTensor" for p in module.parameters()):
        reason = ("its parameters are DTensors (FSDP2 / DTensor): run tplayers.audit(model, *inputs) before "
                  "fully_shard")
        warnings.warn(f"tplayers audit: region '{region.name}' not audited: {reason}", stacklevel=5)
        return reason
    if any(getattr(m, "sequence_parallel", False) for m in module.modules()) and any(region.split):
        return "a sequence-parallel layer alone"
    return ""


class _Sides:
    """Which side of the region is split on this rank, along which dim, and the random output
    gradients of both runs (the TP run's this rank's part of the dense run's)."""

    def __init__(self, region: Region, group: TPGroup) -> None:
        self.region, self.group = region, group
        self.padded: List[int] = []  # a split output's full size, every rank's shards side by side
        self.dims: List[Optional[int]] = []  # (input dim, output dim), decided once the TP forward ran

    def split_dims(self) -> List[Optional[int]]:
        # A layer alone is split on the last dim (its partner is the user's code); a region running
        # sequence-parallel takes and gives (b, s/p, h), unless it enters or leaves the sequence-parallel
        # stream. Read after the TP forward: the hook entering the stream decides, per forward, if it is on.
        if not self.dims:
            region = self.region
            split_out = region.split[1] or getattr(region.module, "gather_output", True) is False  # (loss_parallel)
            self.dims.extend([-1 if region.split[0] else None, -1 if split_out else None])
            sequence = [m for m in region.module.modules() if getattr(m, "sequence_parallel", False)]
            if sequence:
                # a region whose only sequence-parallel layers reduce-scatter its output, with no gather at its entry,
                # takes the whole sequence (a norm before it gathered it: SequenceParallelNorm(gather_output=True))
                whole_in = region.enters_sequence or (all(getattr(m, "input_is_parallel", False) for m in sequence)
                                                      and "gather_sequence" not in getattr(region.module, MARK, ()))
                self.dims[:] = [None if whole_in else -2, None if region.leaves_sequence else -2]
        return self.dims

    def tp_grad(self, out: torch.Tensor) -> torch.Tensor:
        out_dim, g = self.split_dims()[1], self.group
        if out_dim is None:
            return random_like(out.shape, out)
        self.padded.append(out.shape[out_dim] * g.size)
        full = list(out.shape)
        full[out_dim] = self.padded[0]
        return random_like(full, out).chunk(g.size, dim=out_dim)[g.rank].contiguous()

    def dense_grad(self, out: torch.Tensor) -> torch.Tensor:
        out_dim = self.dims[1]
        if out_dim is None:
            return random_like(out.shape, out)
        full = list(out.shape)
        full[out_dim] = max(self.padded[0], out.shape[out_dim])
        return random_like(full, out).narrow(out_dim, 0, out.shape[out_dim])


def check_region(region: Region, result: RegionAudit, group: TPGroup, args: tuple, kwargs: dict,
                 plan_name: str) -> None:
    """Audit ``region`` on copies of the inputs it was just called with: ``result`` filled in, or
    :class:`AuditError` raised on every rank. Collective: every rank of ``group`` calls it."""
    reason = _skip_reason(region)
    if reason:
        result.status, result.reason = "skipped", reason
        return
    module = region.module
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    x = first_float((args, kwargs))
    if x is not None and x.dtype in (torch.bfloat16, torch.float16):  # float32 weights cast to the input's dtype
        dtype = x.dtype  # in forward (nanochat's Linear): the region computes in the input's precision
    cast: Optional[torch.dtype] = None
    if dtype in (torch.bfloat16, torch.float16):
        # A plan's faults do not depend on the precision, but 8-bit rounding through a ReLU or a softmax
        # moves gradients by ~20% (measured: OPT's fc1 in bfloat16, TP vs dense): audit a float32 copy
        # of the region (its TP groups shared), where TP and dense agree to ~1e-6.
        module, cast = float32_copy(module), torch.float32
        region = replace(region, module=module)
        result.note = f"audited in float32 (the model is {str(dtype).replace('torch.', '')})"
    result.tolerance = 0.0 if is_invariant(module) else relative_tolerance(cast or dtype)  # (its twin: TP 1's bits)
    with Quiet(module):
        failure = _run_and_compare(region, result, group, args, kwargs, cast, plan_name)
    _verdict(region, result, group, failure, plan_name)


def _run_and_compare(region: Region, result: RegionAudit, group: TPGroup, args: tuple, kwargs: dict,
                     cast: Optional[torch.dtype], plan_name: str) -> str:
    """Both runs and their comparison (every rank issues the same collectives); the failure text, or ''."""
    a1, k1, diff1 = copy_inputs(args, kwargs, cast)
    a2, k2, diff2 = copy_inputs(args, kwargs, cast)
    sides, tp_error = _Sides(region, group), None
    drawn_from = generator_states()  # the twin draws the random numbers the sharded run draws (torch.rand* in forward)
    try:
        with Kept(region.module):  # (the model's caches and counters as they were: the twin copies them next)
            tp_out, tp_in_grads, tp_grads = run_region(region.module, a1, k1, diff1, sides.tp_grad)
    except Exception as e:  # noqa: BLE001 - re-raised below with the dense twin's verdict
        if _refused_by_tplayers(e):  # a check of tplayers' own refused this input: its message says why
            raise
        tp_error, sides.padded = e, sides.padded or [0]
    # every rank learns whether any rank's sharded run raised, before the collectives below
    raised = all_gather_text("" if tp_error is None else f"{type(tp_error).__name__}: {tp_error}", group=group)
    failed_on = next((r for r, m in enumerate(raised) if m), None)
    in_dim, out_dim = sides.split_dims()
    if in_dim is not None:  # the dense twin takes the whole input
        a2, k2, diff2 = gather_first(a2, k2, group, in_dim)
    try:
        twin = dense_twin(region.module, region.originals, region.added_hooks, group)
        with Quiet(twin):
            set_generator_states(drawn_from)
            dense_out, dense_in_grads, dense_grads = run_region(twin, a2, k2, diff2, sides.dense_grad)
    except Exception as e:  # noqa: BLE001 - no dense twin to compare with: say so, never pass silently
        result.status, result.reason = "skipped", f"its dense twin could not run ({type(e).__name__}: {e})"
        if failed_on is None:  # fail closed: a region tplayers cannot compare with dense does not train
            return (f"it cannot be checked: its dense twin (the region as it was before parallelize) raised "
                    f"{type(e).__name__}: {e}. A plan that changed an attribute the twin also reads (a config object "
                    "or a tuple of sizes shared with the TP layers) makes the twin fail; so can the model itself. "
                    "tplayers refuses to train a region it cannot check; parallelize(..., audit_skip="
                    f"['{name_pattern(region.name)}']) trains this region (and those like it) without the check, "
                    "audit=False every region")
        if tp_error is not None:  # dense and sharded both fail: the model's own error, as it is
            raise tp_error
        raise RuntimeError(f"tplayers audit: region '{region.name}' raised on rank {failed_on}: "
                           f"{raised[failed_on]}") from None
    if failed_on is not None:
        return (f"it raises when sharded but not dense (rank {failed_on}): {raised[failed_on]}\n"
                + likely_causes(region.name, region.module, region.originals, group.size, True, [],
                                raised=raised[failed_on]))
    if out_dim is not None:  # every rank's part of the output, gathered (vocabulary padding cut)
        tp_out = all_gather_tensor(tp_out.contiguous(), out_dim, group=group)
        tp_out = tp_out.narrow(out_dim, 0, dense_out.shape[out_dim])
    if in_dim is not None:
        tp_in_grads = [all_gather_tensor(g.contiguous(), in_dim, group=group) if g is not None and i == 0 else g
                       for i, g in enumerate(tp_in_grads)]
    return _compare(region, result, group, result.tolerance, (tp_out, tp_in_grads, tp_grads),
                    (dense_out, dense_in_grads, dense_grads, twin), plan_name)


def _verdict(region: Region, result: RegionAudit, group: TPGroup, failure: str, plan_name: str) -> None:
    """Every rank's failure text gathered (one collective): passed, or AuditError on every rank."""
    messages = all_gather_text(failure, group=group)
    first = next(((r, m) for r, m in enumerate(messages) if m), None)
    if first is None:
        if result.status == "pending":
            result.status = "passed"
        return
    rank, message = first
    result.status, result.reason = "failed", message.split("\n", 1)[0]
    where = f"region '{region.name}' ({type(region.module).__name__}" + (
        f", audited for {result.instances} regions like it" if result.instances > 1 else "") + ")"
    result.message = (f"tplayers audit (plan '{plan_name}', TP {group.size}, rank {rank}): {where} does not compute "
                      f"what its dense twin computes: {message}\nThe forward stopped before any optimizer step. Fix "
                      "the plan (docs/models.md, 'Plans for your own model'), or parallelize(..., audit=False) to "
                      "skip the audit.")
    raise AuditError(result.message)


def _compare(region: Region, result: RegionAudit, tp: TPGroup, tol: float, tp_run: tuple, dense_run: tuple,
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
    twin_dense = dense_tensors(twin, lambda name, p: dense_grads.get(id(p)))  # (a tp_invariant twin's TP-1 layers)
    # A gradient that is zero in exact arithmetic (a key bias: the softmax cancels it) is rounding noise of about
    # eps x the region's largest gradient on both sides, and the two noises differ. Each gradient is compared
    # relative to at least sqrt(tol) x the largest: noise passes (float32: 1e-6 x the largest, ~10 eps), and a
    # gradient under 1% of the largest that is wrong by more than 1e-4 of the largest is still caught.
    floor = math.sqrt(tol) * max([scale_of(g) for g in twin_dense.values()] + [0.0])
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


