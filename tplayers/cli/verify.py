"""``tplayers verify``: every TP module against its dense reference, as a table and an exit status.

Runs the registered checks (:mod:`tplayers.cli.registry`, :mod:`tplayers.cli.checks`) on every rank;
the ranks agree on each result, so the table and the exit status are the same everywhere.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Dict, Iterable, List, Sequence

import torch

from ..bench.timing import Progress
from ..core.comm import all_gather_tensor
from ..core.groups import TPGroup, resolve_group
from . import checks  # noqa: F401  (registers every check)
from .registry import CHECKS, LOW_PRECISION, Check, CheckResult, VerifyConfig, register, select_checks, tolerance

__all__ = ["VerifyConfig", "Check", "CheckResult", "CHECKS", "register", "select_checks", "run_checks", "tolerance",
           "LOW_PRECISION", "merge_rank_results", "format_table", "report_json", "exit_code", "SCHEMA"]

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


def run_checks(group: Any, names: Sequence[str], cfg: VerifyConfig) -> List[CheckResult]:
    """Run the named checks on this rank (collective: every rank of ``group`` calls it)."""
    g = resolve_group(group)
    by_name = {c.name: c for c in CHECKS}
    device = cfg.torch_device()
    results = []
    bar = Progress(len(names), f"verify tp={g.size}", cfg.progress and g.rank == 0)
    for name in names:
        bar.step(0, name)
        check = by_name[name]
        cfg = replace(cfg, tol_scale=check.tol_scale)
        rtol, atol = tolerance(cfg)  # what the check compares with (checks._match)
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
