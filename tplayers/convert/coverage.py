"""What ``parallelize`` did to a model: which modules became which TP layer, what stays replicated
(and whether its gradient is summed over the group), which plan patterns matched nothing, what was
left out and why, and the fraction of parameters sharded. ``print(tplayers.coverage(model))``."""
from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Tuple

import torch.nn as nn

from ..layers.base import TensorParallelModule, model_placements
from ..layers.conv1d import is_conv1d
from ..core.placement import Sharded
from .plan import Plan
from .styles import Built, Style

__all__ = ["CoverageReport", "coverage", "build_report", "report_coverage", "REPORT_ATTR"]

REPORT_ATTR = "_tplayers_coverage"


@dataclass
class CoverageReport:
    """``parallelize``'s account of a model (see the module docstring). ``complete``: every linear
    layer is a TP layer or was named by the plan (e.g. ``"replicate"``), and nothing was left out."""

    plan: str
    model: str
    layers: Dict[str, str]  # module -> what it became (a TP layer class, or the hooks a style added)
    replicated: Dict[str, str]  # parameter -> "gradient summed over the TP group" / "complete gradient on every rank"
    dense_layers: List[str]  # linear layers no plan entry named: they stay dense on every rank
    unmatched: List[str]  # plan patterns that matched no module
    skipped: Dict[str, str] = field(default_factory=dict)  # module or parameter -> why it was left as it is
    sharded_params: int = 0  # dense element count of the sharded parameters
    total_params: int = 0  # dense element count of every parameter (tied ones once)
    audit: Any = None  # the AuditReport (tplayers.convert.audit): each distinct region vs its dense twin
    uneven: Dict[str, str] = field(default_factory=dict)  # parameter -> its rows per rank, where they differ
    largest_share: float = 1.0  # the most a rank holds of the sharded parameters, over an even split's share
    notes: List[str] = field(default_factory=list)  # sub-models a plan splits thinly (a VLM's text tower), said

    @property
    def sharded_fraction(self) -> float:
        return self.sharded_params / self.total_params if self.total_params else 0.0

    @property
    def complete(self) -> bool:
        return not self.dense_layers and not self.skipped

    def __str__(self) -> str:
        lines = [f"tplayers coverage of {self.model} (plan '{self.plan}'): {self.sharded_fraction:.1%} of "
                 f"{self.total_params:,} parameters sharded"]
        if self.uneven:
            lines.append(f"  uneven splits: the largest rank holds {self.largest_share:.3f}x an even split's share of "
                         "the sharded parameters (every rank is padded to it)")
        lines += _section("TP layers", _grouped(f"{n}: {v}" for n, v in self.layers.items()))
        lines += _section("replicated parameters", _grouped(f"{n}: {v}" for n, v in self.replicated.items()))
        lines += _section("uneven splits (rows per rank)", _grouped(f"{n}: {v}" for n, v in self.uneven.items()))
        lines += _section("left dense (no plan entry)", _grouped(self.dense_layers))
        lines += _section("left out", _grouped(f"{n}: {v}" for n, v in self.skipped.items()))
        lines += _section("plan patterns that matched nothing", self.unmatched)
        lines += _section("thin", self.notes)
        if self.audit is not None:
            lines += ["  " + line for line in str(self.audit).splitlines()]
        return "\n".join(lines)


def _section(title: str, rows: List[str]) -> List[str]:
    return [f"  {title} ({len(rows)}):"] + [f"    {r}" for r in rows] if rows else []


def _grouped(rows: Iterable[str]) -> List[str]:
    """Rows that differ only in layer indices, once each with a count: ``layers.*.mlp.up_proj: ... (x32)``."""
    counts = Counter(re.sub(r"\.\d+\.", ".*.", r) for r in rows)
    return [f"{r} (x{c})" if c > 1 else r for r, c in counts.items()]


def _is_weight_layer(module: nn.Module) -> bool:
    """A layer a TP plan is expected to split. Embeddings other than the vocabulary's (positions,
    token types) are small and meant to stay replicated, so they do not count."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _dense_numel(param: nn.Parameter, placement: Any) -> int:
    """The element count of ``param``'s dense tensor (a shard's full shape; a replicated parameter's own)."""
    return math.prod(placement.full_shape(tuple(param.shape))) if isinstance(placement, Sharded) else param.numel()


def build_report(model: nn.Module, plan_name: str, layers: Dict[str, str], named: Iterable[str],
                 unmatched: List[str], skipped: Dict[str, str]) -> CoverageReport:
    """The report of ``model`` after the swap. ``named``: every module a plan entry took (it is not
    'left dense', even if its style kept it as it is)."""
    named = set(named)
    placements = model_placements(model)
    tp_prefixes = [f"{n}." for n, m in model.named_modules() if isinstance(m, TensorParallelModule)]
    replicated: Dict[str, str] = {}
    uneven: Dict[str, str] = {}
    tp_size = next((m.group.size for m in model.modules() if isinstance(m, TensorParallelModule)), 1)
    held = [0] * tp_size  # the sharded elements each rank holds (its real rows, not padding)
    sharded = total = 0
    for name, param in model.named_parameters():
        placement = placements.get(name)
        numel = _dense_numel(param, placement)
        if isinstance(placement, Sharded):
            per_row = numel // max(placement.full_size, 1)
            rows = [sum(p.length for p in placement.pieces(r, tp_size)) for r in range(tp_size)]
            held = [h + n * per_row for h, n in zip(held, rows)]
            if len(set(rows)) > 1:
                uneven[name] = f"{', '.join(map(str, rows))} (padded to {placement.local_size})"
            sharded += numel
        else:
            replicated[name] = ("gradient summed over the TP group" if placement is not None and placement.partial_grad
                                else "complete gradient on every rank")
        total += numel
    dense = [n for n, m in model.named_modules()
             if n and _is_weight_layer(m) and not isinstance(m, TensorParallelModule) and n not in named
             and n not in skipped and not any(n.startswith(p) for p in tp_prefixes)]
    return CoverageReport(plan=plan_name, model=type(model).__name__, layers=layers, replicated=replicated,
                          dense_layers=dense, unmatched=list(unmatched), skipped=dict(skipped),
                          sharded_params=sharded, total_params=total, uneven=uneven,
                          largest_share=max(held) * tp_size / sum(held) if sum(held) else 1.0)


def coverage(model: nn.Module) -> CoverageReport:
    """The :class:`CoverageReport` of the last ``parallelize`` call on ``model``."""
    report = getattr(model, REPORT_ATTR, None)
    if report is None:
        raise ValueError(f"tplayers.coverage: {type(model).__name__} was not parallelized (no report); "
                         "call tplayers.parallelize(model, plan, group=...) first")
    return report


# ---------------------------------------------------------------------------- made by parallelize


def _describe(built: Dict[str, Built], modules: Dict[str, nn.Module], styles: Dict[str, Style],
              matched: List[Tuple[str, str]]) -> Dict[str, str]:
    """module -> what it became, for the coverage report."""
    style_of = dict(matched)
    out = {}
    for name, b in built.items():
        if b.module is not modules[name]:
            note = getattr(b.module, "_coverage_note", None)  # (e.g. a kernel it cannot take at its shard's shape)
            out[name] = type(b.module).__name__ + (f" ({note})" if note else "")
        elif b.label is not None:
            out[name] = b.label
        elif b.finish is not None:
            out[name] = f"{type(b.module).__name__} with {type(styles[style_of[name]]).__name__} hooks"
    return out


def _thin_sub_models(model: nn.Module) -> List[str]:
    """Sub-models with a config of their own (a VLM's text tower) whose own plan split under half of their dense
    parameters while linear layers in them stay whole (Qwen3-VL's names only the embedding)."""
    placements = model_placements(model)
    notes: Dict[str, str] = {}
    for path, sub in model.named_modules():
        config = getattr(sub, "config", None)
        if not path or config is None or config is getattr(model, "config", None) \
                or any(path.startswith(n + ".") for n in notes):
            continue
        params = [(n, p, placements.get(f"{path}.{n}")) for n, p in sub.named_parameters()]
        split = sorted({n.rpartition(".")[0] for n, _, pl in params if isinstance(pl, Sharded)})
        whole = [n for n, m in sub.named_modules() if _is_weight_layer(m) and not isinstance(m, TensorParallelModule)]
        if not split or not whole:
            continue
        fraction = (sum(_dense_numel(p, pl) for _, p, pl in params if isinstance(pl, Sharded))
                    / max(sum(_dense_numel(p, pl) for _, p, pl in params), 1))
        if fraction < 0.5:
            notes[path] = (f"'{path}': the model's own plan splits {fraction:.0%} of its parameters ({', '.join(split)}); "
                           f"{len(whole)} linear layers in it stay whole (a plan of your own can split its attention "
                           "and MLP: docs/models.md)")
    return list(notes.values())


def report_coverage(model: nn.Module, p: Plan, plan: object, built: Dict[str, Built], modules: Dict[str, nn.Module],
            styles: Dict[str, Style], matched: List[Tuple[str, str]], used: set, unmatched_keys: List[str],
            skipped: Dict[str, str]) -> None:
    """Store the coverage report on the model; warn when a shipped or "auto" plan covers only part
    of it, or when patterns of the user's own plan matched nothing."""
    # Patterns of shipped plans list alternatives (with / without a head, a prefix): not reported.
    unmatched = unmatched_keys if p.name == "auto" else [] if isinstance(plan, str) else [
        pat for pat in styles if pat not in used]
    report = build_report(model, p.name, _describe(built, modules, styles, matched), (n for n, _ in matched),
                          unmatched, skipped)
    report.notes = _thin_sub_models(model) if p.name == "auto" else []
    object.__setattr__(model, REPORT_ATTR, report)  # a plain attribute: not a submodule, not in the state dict
    if isinstance(plan, str) and not report.complete:
        warnings.warn(f"parallelize: plan '{p.name}' covers only part of {type(model).__name__}; what stays dense "
                      f"runs whole on every rank (correct, but no memory saved):\n{report}", stacklevel=3)
    elif unmatched and not isinstance(plan, str):
        warnings.warn(f"parallelize: plan pattern(s) {unmatched} matched no module of {type(model).__name__} "
                      "(or only modules an earlier pattern took); those modules stay as they are", stacklevel=3)
