"""The benchmark's JSON report: config, environment, per-mode timings and the derived overlap figures.
Its keys are a schema (``SCHEMA``): bump the version when they change."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import math
import statistics
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._version import __version__
from ..core.groups import TPGroup
from .timing import Timing

__all__ = ["SCHEMA", "SCHEDULES", "summarize", "backend_name", "median_interval", "quartiles", "ratio_interval"]

SCHEMA = "tplayers-bench/3"
# /2: summary.overlap_saving_ci_ms, hidden_fraction_ci, within_noise; config.link and "link"; summary.exposed_comm_ms
#     MEASURED (accounting), the old estimate exposed_comm_estimate_ms
# /3: one headline (summary.headline: the overlapped step / max(matmuls alone, collectives alone) and / the
#     blocking step, with intervals); "schedules" (one entry per timed TP mode, replacing split_backward, chunked,
#     collective_matmul); hidden fractions from comm accounting only, in [0, 1], of the timed iterations
#     themselves; link.calibration; config.default_link. Gone: overlap_saving_*, hidden_fraction_ci / _min,
#     within_noise (now headline.within_noise), comm_bwd_ms, exposed_comm_estimate_ms,
#     backward_hidden_fraction_measured (now backward_hidden_fraction), config.accounting_iters

# the TP schedules (timed modes that run the TP model), in the order of the table
SCHEDULES = ("tp", "tp_blocking", "tp_split", "tp_chunked", "tp_cm")


def backend_name(g: TPGroup, device: torch.device) -> str:
    """The process group's backend (``"none"`` for a world of one)."""
    if g.process_group is None:
        return "none"
    import torch.distributed as dist

    return str(dist.get_backend(g.process_group))


def median_interval(values: List[float], z: float = 1.96) -> Tuple[float, float]:
    """A distribution-free ~95% confidence interval for the median of ``values``: the order
    statistics ``k`` and ``n - 1 - k`` with ``k = floor(n/2 - z*sqrt(n)/2)`` (the normal
    approximation to Binomial(n, 1/2)); the whole range when n is too small for that."""
    ordered = sorted(values)
    n = len(ordered)
    k = max(0, math.floor(n / 2 - z * math.sqrt(n) / 2))
    return ordered[k], ordered[n - 1 - k]


def quartiles(values: Sequence[float]) -> Tuple[float, float, float]:
    """``(median, lower quartile, upper quartile)`` of ``values`` as order statistics (the value at index
    ``floor(f * n)`` of the sorted values, f = 0.5, 0.25, 0.75): what the benchmarks report for paired
    step ratios."""
    ordered = sorted(values)
    n = len(ordered)
    at = lambda f: ordered[min(n - 1, int(f * n))]  # noqa: E731
    return at(0.5), at(0.25), at(0.75)


def _environment(tp: int, backend: str, cfg: Any) -> Dict[str, Any]:
    return {
        "torch": torch.__version__,
        "tplayers": __version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads_per_rank": torch.get_num_threads(),
        "tp": tp,
        "backend": backend,
        "device": cfg.device if cfg.device == "cpu" else torch.cuda.get_device_name(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def ratio_interval(num: List[float], dens: List[List[float]], *, reps: int = 2000, level: float = 0.95,
                   seed: int = 0) -> Tuple[float, float]:
    """A ~95% interval for median(num) / max(median(d) for d in dens), the per-iteration values
    paired (iteration i of every list ran in the same interleaved round): the percentile bootstrap
    over rounds, resampled together (fixed seed: the same times give the same interval). It always
    holds the point estimate."""
    point = statistics.median(num) / max(statistics.median(d) for d in dens)
    n = len(num)
    if n < 2:
        return point, point
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(n, (reps, n), generator=gen)

    def medians(values: List[float]) -> torch.Tensor:  # (reps,): the median of each resample
        return torch.tensor(values, dtype=torch.float64)[idx].quantile(0.5, dim=1)

    ratios = medians(num) / torch.stack([medians(d) for d in dens]).amax(0)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(ratios, q).tolist()
    return min(lo, point), max(hi, point)


def _accounted(rows: List[List[float]], steps_ms: List[float]) -> Dict[str, Any]:
    """A schedule's exposure from its timed iterations (rows: `measure.ACCOUNTING_COLUMNS` of the
    slowest rank of each iteration, ms), per phase the median over iterations of the time the
    caller was blocked on the phase's collectives and of the time they were in flight.

    Constructed to be consistent: per iteration the exposed time is capped at the time in flight
    (it lies inside it; the cap only absorbs clock noise), so each phase's median exposed <= its
    median in flight; the totals are the sums of the phases; when that sum would exceed the step's
    median (phases whose medians come from different iterations) both phases are scaled down to
    it. Hence exposed <= in flight, exposed <= step, and every hidden fraction 1 - exposed / in
    flight lies in [0, 1]."""
    med = statistics.median
    e_f = med([min(max(r[0], 0.0), r[2]) for r in rows])
    e_b = med([min(max(r[1], 0.0), r[3]) for r in rows])
    d_f, d_b = med([r[2] for r in rows]), med([r[3] for r in rows])
    step = med(steps_ms)
    if e_f + e_b > step > 0:
        e_f = e_f * step / (e_f + e_b)
        e_b = step - e_f  # (so that the sum is the step exactly, whatever the rounding)

    def hidden(exposed: float, in_flight: float) -> Optional[float]:
        return None if in_flight <= 0 else min(1.0, max(0.0, 1.0 - exposed / in_flight)) + 0.0

    return {"exposed_comm_ms": min(e_f + e_b, step) if step > 0 else e_f + e_b, "exposed_comm_fwd_ms": e_f, "exposed_comm_bwd_ms": e_b,
            "comm_in_flight_ms": d_f + d_b, "comm_in_flight_fwd_ms": d_f, "comm_in_flight_bwd_ms": d_b,
            "hidden_fraction": hidden(e_f + e_b, d_f + d_b), "forward_hidden_fraction": hidden(e_f, d_f),
            "backward_hidden_fraction": hidden(e_b, d_b)}


def _schedule(name: str, t: Dict[str, Timing], accounting: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """One TP schedule's figures: its step, its ratios to the limit and to the blocking step (with
    their intervals), and its exposure (when accounted)."""
    times = t[name].times
    out: Dict[str, Any] = {"step_ms": t[name].median_ms}
    if "comm" in t and "compute" in t and max(t["comm"].median_ms, t["compute"].median_ms) > 0:
        limit = max(t["comm"].median_ms, t["compute"].median_ms)
        out["vs_limit"] = t[name].median_ms / limit
        out["vs_limit_ci"] = list(ratio_interval(times, [t["comm"].times, t["compute"].times]))
    if "tp_blocking" in t and t["tp_blocking"].median_ms > 0:
        out["vs_blocking"] = t[name].median_ms / t["tp_blocking"].median_ms
        out["vs_blocking_ci"] = list(ratio_interval(times, [t["tp_blocking"].times]))
    if accounting is not None:
        out.update(_accounted(accounting["rows"], [1e3 * x for x in times]))
        for key in ("collectives_per_step", "bytes_per_step", "chunks"):
            if key in accounting:
                out[key] = accounting[key]
    return out


def _headline(t: Dict[str, Timing], schedules: Dict[str, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The overlapped step (mode tp) against what no schedule can beat, max(matmuls alone,
    collectives alone), and against the blocking schedule."""
    if "tp" not in schedules:
        return None
    tp = schedules["tp"]
    h: Dict[str, Any] = {"schedule": "tp", "step_ms": tp["step_ms"]}
    if "vs_limit" in tp:
        comm, compute = t["comm"].median_ms, t["compute"].median_ms
        h.update(limit_ms=max(comm, compute), limit_by="comm" if comm >= compute else "compute", comm_ms=comm,
                 compute_ms=compute, vs_limit=tp["vs_limit"], vs_limit_ci=tp["vs_limit_ci"])
    if "vs_blocking" in tp:
        lo, hi = tp["vs_blocking_ci"]
        h.update(blocking_ms=t["tp_blocking"].median_ms, vs_blocking=tp["vs_blocking"], vs_blocking_ci=tp["vs_blocking_ci"],
                 within_noise=lo <= 1.0 <= hi)
    return h


def summarize(cfg: Any, tp: int, timings: Dict[str, Timing], skipped: Optional[Dict[str, str]] = None,
              backend: str = "gloo", accounting: Optional[Dict[str, Dict[str, Any]]] = None, link: Any = None,
              calibration: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The JSON report: config, link, environment, per-mode min/median, every TP schedule's figures,
    and the summary (its headline, and the overlapped schedule's figures).

    ``accounting``: per accounted TP mode, ``rows`` (`measure.ACCOUNTING_COLUMNS` of each timed
    iteration, from that iteration's slowest rank), ``collectives_per_step``, ``bytes_per_step``.

    The headline: the overlapped step (mode ``tp``, median) as a ratio of the limit max(matmuls
    alone, collectives alone) (medians: no schedule of these collectives and matmuls beats it) and of
    the blocking step (``tp_blocking``), each with a 95% interval over the interleaved rounds
    (`ratio_interval`). Every ratio is the ratio of the medians in ``timings``. Hidden fractions have
    one definition, the accounting's: 1 - (time callers were blocked on the collectives) / (the time
    they were in flight), medians over the timed iterations, in [0, 1] by construction (see
    `_accounted`); exposed <= in flight and exposed <= the step.
    """
    t = timings
    accounting = accounting or {}
    schedules = {name: _schedule(name, t, accounting.get(name)) for name in SCHEDULES if name in t}
    summary: Dict[str, Any] = {}
    headline = _headline(t, schedules)
    if headline is not None:
        summary["headline"] = headline
        keep = ("exposed_comm_ms", "exposed_comm_fwd_ms", "exposed_comm_bwd_ms", "comm_in_flight_ms",
                "comm_in_flight_fwd_ms", "comm_in_flight_bwd_ms", "hidden_fraction", "forward_hidden_fraction",
                "backward_hidden_fraction", "collectives_per_step", "bytes_per_step")
        summary.update({k: schedules["tp"][k] for k in keep if k in schedules["tp"]})
    for other in ("dense", "naive"):
        if "tp" in t and other in t:
            summary[f"speedup_vs_{other}"] = t[other].median_ms / t["tp"].median_ms
    link_record = None
    if link is not None:
        link_record = {"spec": link.spec, "bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us,
                       "emulated": True}
        if calibration is not None:
            link_record["calibration"] = calibration
    return {
        "schema": SCHEMA,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()
                   if k not in ("progress", "trace_dir", "trace_iters")},
        "link": link_record,
        "environment": _environment(tp, backend, cfg),
        "timings": {name: timing.as_dict() for name, timing in t.items()},
        "skipped": dict(skipped or {}),
        "schedules": schedules,
        "summary": summary,
    }
