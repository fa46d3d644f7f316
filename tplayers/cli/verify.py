"""``tplayers verify``: every TP module against its dense reference, as a table and an exit status.

Runs the registered checks (:mod:`tplayers.cli.registry`, :mod:`tplayers.cli.checks`) on every rank;
the ranks agree on each result, so the table and the exit status are the same everywhere.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import sys
from dataclasses import replace
from typing import Any, Dict, Iterable, List, Sequence

import torch
import torch.nn as nn

from ..bench.timing import Progress
from ..core.blocking import all_gather_tensor
from ..convert.audit import audit
from ..convert.parallelize import parallelize
from ..convert.twin import first_float
from ..core.dtypes import DTYPES
from ..core.groups import TPGroup, resolve_group
from ..testing.dense_match import MatchReport
from . import checks  # noqa: F401  (registers every check)
from ._launch import run_on_ranks, under_torchrun
from .output import print_out
from .registry import CHECKS, LOW_PRECISION, Check, CheckResult, VerifyConfig, register, select_checks, tolerance

__all__ = ["VerifyConfig", "Check", "CheckResult", "CHECKS", "register", "select_checks", "run_checks", "tolerance",
           "LOW_PRECISION", "merge_rank_results", "format_table", "report_json", "exit_code", "SCHEMA",
           "user_model_check", "load_object", "verify_command"]

SCHEMA = "tplayers-verify/2"  # /2 added rtol and atol to each result; every /1 key is unchanged


def _agree(g: TPGroup, values: List[float], device: torch.device) -> List[float]:
    """Element-wise max of ``values`` over the ranks of ``g`` (NaN wins)."""
    t = torch.tensor([values], dtype=torch.float64, device=device)
    if g.size > 1:
        t = all_gather_tensor(t, 0, group=g)  # (p, n)
    worst = t.nan_to_num(nan=-math.inf).amax(0)
    worst[t.isnan().any(0)] = math.nan
    return [float(v) for v in worst.cpu()]


def _attempt(check: Check, g: TPGroup, cfg: VerifyConfig) -> tuple:
    torch.manual_seed(cfg.seed)
    try:
        report = check.fn(g, cfg)
        return report.output_error, report.grad_error, ""
    except Exception as e:  # a mismatch (AssertionError) or an error building/running the module
        return math.nan, math.nan, f"{type(e).__name__}: {e}"


def load_object(spec: str, what: str) -> Any:
    """``pkg.module:name`` (``name`` may be dotted) imported from the current directory or sys.path."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} '{spec}': expected 'pkg.module:name'")
    if os.getcwd() not in sys.path:  # as `python -m`: the user's own package, from where they run
        sys.path.insert(0, os.getcwd())
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} '{spec}': {module_name} has no '{attr}'")
        obj = getattr(obj, part)
    return obj


def user_model_check(group: TPGroup, cfg: VerifyConfig) -> MatchReport:
    """Your own model and plan: ``build()`` (from ``--model``) returns ``(model, example_inputs)``, a
    tiny dense instance and its inputs (a tensor or a tuple), called under the same seed on every
    rank; the model is parallelized with ``--plan`` (default "auto") and audited region by region
    (:mod:`tplayers.convert.audit`), then its whole output compared with the dense model's."""
    build = load_object(cfg.model, "--model")
    plan = load_object(cfg.plan, "--plan") if cfg.plan else "auto"
    built = build()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module)):
        raise TypeError(f"--model {cfg.model}: build() must return (model, example_inputs), got {type(built).__name__}")
    model, inputs = built
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    device, dtype = cfg.torch_device(), cfg.torch_dtype
    model = model.to(device=device, dtype=dtype)
    inputs = tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                   if isinstance(t, torch.Tensor) else t for t in inputs)
    dense = copy.deepcopy(model)
    parallelize(model, plan, group=group, audit=False)
    report = audit(model, *inputs)  # AuditError on a mismatch, on every rank
    with torch.no_grad():
        out, want = first_float(model(*inputs)), first_float(dense(*inputs))
    if out is None or want is None:
        raise TypeError(f"--model {cfg.model}: the model's output holds no floating-point tensor")
    scale = float(want.abs().max()) or 1.0
    out_err = float((out.double() - want.double()).abs().max()) / scale
    audited = [r for r in report.regions if r.status == "passed"]
    if not audited:
        raise AssertionError(f"--model {cfg.model}: no region was audited:\n{report}")
    limit = max(r.tolerance for r in audited)
    if not out_err <= limit:
        raise AssertionError(f"the whole model's output differs from the dense model's: relative error {out_err:.2e} "
                             f"> {limit:g}, although every region passed (something outside the regions)")
    grad = max((v for r in audited for k, v in r.errors.items() if "gradient" in k), default=0.0)
    return MatchReport(output_error=out_err, param_grad_error=grad)


def run_checks(group: Any, names: Sequence[str], cfg: VerifyConfig) -> List[CheckResult]:
    """Run the named checks on this rank (collective: every rank of ``group`` calls it)."""
    g = resolve_group(group)
    by_name = {c.name: c for c in CHECKS}
    if cfg.model:  # registered here, in the rank's process, from the spec
        check = Check("model", cfg.model, user_model_check)
        by_name[check.name] = check
    device = cfg.torch_device()
    results = []
    bar = Progress(len(names), f"verify tp={g.size}", cfg.progress and g.rank == 0)
    for name in names:
        bar.step(0, name)
        check = by_name[name]
        cfg = replace(cfg, tol_scale=check.tol_scale)
        rtol, atol = tolerance(cfg)  # what the check compares with (checks.match_dense)
        fwd, grad, message = _attempt(check, g, cfg)
        failed = 1.0 if message else 0.0
        fwd, grad, any_failed = _agree(g, [fwd, grad, failed], device)
        if any_failed:
            # Measure the errors without tolerances so the table shows how far off it is.
            m_fwd, m_grad, _ = _attempt(check, g, replace(cfg, rtol=math.inf, atol=math.inf))
            fwd, grad, _ = _agree(g, [m_fwd, m_grad, 0.0], device)
            if not message:
                message = "failed on another rank"
        results.append(CheckResult(name, g.size, fwd, grad, not any_failed, message, rtol, atol))
        bar.step(1, name)
    return results


def _worst(values: Iterable[float]) -> float:
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def merge_rank_results(per_rank: Sequence[Sequence[CheckResult]]) -> List[CheckResult]:
    """One result per check from every rank's: worst error, failed if any rank failed."""
    merged = []
    for rows in zip(*per_rank):
        first = rows[0]
        bad = [r for r in rows if not r.passed]
        message = next((r.message for r in bad if r.message and r.message != "failed on another rank"),
                       bad[0].message if bad else "")
        merged.append(CheckResult(first.name, first.tp, _worst(r.forward_error for r in rows),
                                  _worst(r.grad_error for r in rows), not bad, message, first.rtol, first.atol))
    return merged


def _fmt_err(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2e}"


def _fmt_tol(r: CheckResult) -> str:
    return "n/a" if math.isnan(r.rtol) or math.isnan(r.atol) else f"{r.rtol:g}/{r.atol:g}"


def format_table(results: Sequence[CheckResult], tolerances: bool = False) -> str:
    """The verify table: check, TP size, max forward error, max gradient error, PASS/FAIL; with
    ``tolerances`` (bfloat16/float16, where each check scales them) also the rtol/atol each check used."""
    header = ("module", "TP", "max fwd err", "max grad err") + (("rtol/atol",) if tolerances else ()) + ("result",)
    rows = [(r.name, str(r.tp), _fmt_err(r.forward_error), _fmt_err(r.grad_error))
            + ((_fmt_tol(r),) if tolerances else ()) + ("PASS" if r.passed else "FAIL",)
            for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    align = ["<"] + [">"] * (len(header) - 2) + ["<"]
    line = lambda cells: "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths)).rstrip()  # noqa: E731
    out = [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]
    failures = [r for r in results if not r.passed]
    n = len(results)
    out.append("")
    out.append(f"{n - len(failures)}/{n} checks passed" if n else "no checks selected")
    for r in failures:
        out.append(f"FAIL {r.name} (TP {r.tp}): {r.message.splitlines()[0] if r.message else 'failed'}")
    return "\n".join(out)


def report_json(results: Sequence[CheckResult], dtype: str, device: str) -> Dict[str, Any]:
    """The ``--json`` report. An error that could not be measured (NaN) is ``null``: strict JSON.

    Schema ``tplayers-verify/2``: /1's keys plus ``rtol`` and ``atol`` per result."""
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in vars(r).items()} for r in results]
    return {"schema": SCHEMA, "dtype": dtype, "device": device, "results": rows,
            "passed": exit_code(results) == 0}


def exit_code(results: Sequence[CheckResult]) -> int:
    """0 when every check passed (and there was at least one), else 1."""
    return 0 if results and all(r.passed for r in results) else 1


# ---------------------------------------------------------------------------- the command


def verify_command(args: argparse.Namespace) -> int:
    """``tplayers verify`` with parsed arguments: run the checks on the ranks, print, return the exit status."""
    if args.plan and not args.model:
        print("tplayers verify: --plan goes with --model", file=sys.stderr)
        return 2
    selected = select_checks(args.only) if not args.model else [Check("model", args.model, user_model_check)]
    if args.list:
        print_out("\n".join(c.name for c in CHECKS))
        return 0
    if not selected:
        print(f"tplayers verify: no check matches {args.only}; see tplayers verify --list", file=sys.stderr)
        return 2
    progress = args.progress if args.progress is not None else (sys.stderr.isatty() and not args.json)
    cfg = VerifyConfig(dtype=args.dtype, device=args.device, seed=args.seed, rtol=args.rtol, atol=args.atol,
                       progress=progress, model=args.model, plan=args.plan)
    names = [c.name for c in selected]
    sizes = args.tp or [None]
    results: List[CheckResult] = []
    reporter = True
    for size in sizes:
        per_rank, reporter = run_on_ranks(run_checks, names, cfg, tp=size, device=args.device,
                                          backend=args.backend, threads=args.threads, timeout_s=args.timeout)
        results += merge_rank_results(per_rank)
    if under_torchrun():
        results = _merge_over_world(results, args.device)
    if reporter:
        _print_results(args, results, len(names), len(sizes))
    return exit_code(results)


def _print_results(args: argparse.Namespace, results: List[CheckResult], n_checks: int, n_sizes: int) -> None:
    if args.json:
        print_out(json.dumps(report_json(results, args.dtype, args.device), indent=2, allow_nan=False))
        return
    low_precision = DTYPES[args.dtype] in LOW_PRECISION  # per-check tolerances: a column
    tol = ("--rtol/--atol" if args.rtol is not None or args.atol is not None else
           "the audit's, relative to scale" if args.model else
           "default_tolerance(dtype)" + (" x per-check scale" if low_precision else ""))
    count = f"{n_checks} checks" + (f" x {n_sizes} TP sizes = {n_checks * n_sizes}" if n_sizes > 1 else "")
    print_out(f"tplayers verify: {count}, dtype={args.dtype}, device={args.device}, "
              f"tolerance {tol}; reference: dense torch.nn, same weights")
    print_out(format_table(results, tolerances=low_precision))
    if args.model:  # the audit's whole message: the region, the worst tensor, the likely cause
        print_out("\n".join(f"\nTP {r.tp}: {r.message}" for r in results if not r.passed and r.message))


def _merge_over_world(results: List[CheckResult], device: str) -> List[CheckResult]:
    """Under torchrun with several TP groups: the worst result of every group, on every rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1 or not results:
        return results
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    local = [v for r in results for v in (r.forward_error, r.grad_error, 0.0 if r.passed else 1.0)]
    worst = _agree(resolve_group(dist.group.WORLD), local, dev)  # NaN-aware max over every rank
    for i, r in enumerate(results):
        fwd, grad, failed = worst[3 * i: 3 * i + 3]
        r.forward_error, r.grad_error = fwd, grad
        if failed and r.passed:
            r.passed, r.message = False, "failed in another TP group"
    return results
