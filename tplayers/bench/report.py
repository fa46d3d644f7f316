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
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._version import __version__
from ..core.groups import TPGroup
from .timing import Timing

__all__ = ["SCHEMA", "summarize", "backend_name", "median_interval"]

SCHEMA = "tplayers-bench/2"  # /2: summary.overlap_saving_ci_ms, hidden_fraction_ci, within_noise; config.link and
# "link"; summary.exposed_comm_ms now MEASURED (accounting), the old estimate is exposed_comm_estimate_ms


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


def summarize(cfg: Any, tp: int, timings: Dict[str, Timing], skipped: Optional[Dict[str, str]] = None,
              backend: str = "gloo", measured: Optional[Dict[str, Any]] = None, link: Any = None) -> Dict[str, Any]:
    """The JSON report: config, environment, per-mode min/median, and the derived overlap figures.

    ``hidden_fraction``: of the backward collectives' own time (``comm_bwd``, median), the share
    the overlap saves, from the per-iteration paired difference (blocking - overlapped), median.
    ``overlap_saving_ci_ms`` / ``hidden_fraction_ci``: a ~95% interval for that median
    (`median_interval` over the paired differences); ``within_noise``: the interval holds 0, so
    this run cannot tell overlap on from off. ``hidden_fraction_min``: the same from the minima
    (blocking min - overlapped min) / comm min. They can leave [0, 1] through noise: reported as
    measured, not clamped. ``exposed_comm_ms``: the time callers were blocked on collectives per
    overlapped step, measured by comm accounting (slowest rank, median; also ``_fwd_ms`` /
    ``_bwd_ms``), beside ``exposed_comm_estimate_ms`` = overlapped - matmuls alone (medians).
    ``forward_hidden_fraction`` / ``backward_hidden_fraction_measured``: from the accounting, 1 -
    (time blocked on the phase's collectives) / (their launch-to-completion time); the forward has
    no overlap yet, so about 0 (null when the phase has no collective).
    """
    summary: Dict[str, Any] = {}
    t = timings
    if "tp" in t and "tp_blocking" in t:
        saved = [b - a for a, b in zip(t["tp"].times, t["tp_blocking"].times)]
        summary["overlap_saving_ms"] = 1e3 * statistics.median(saved)
        lo, hi = median_interval(saved)
        summary["overlap_saving_ci_ms"] = [1e3 * lo, 1e3 * hi]
        summary["within_noise"] = lo <= 0.0 <= hi
        if "comm_bwd" in t and tp > 1 and t["comm_bwd"].median_ms > 0:
            summary["comm_bwd_ms"] = t["comm_bwd"].median_ms
            summary["hidden_fraction"] = summary["overlap_saving_ms"] / t["comm_bwd"].median_ms
            summary["hidden_fraction_ci"] = [1e3 * lo / t["comm_bwd"].median_ms, 1e3 * hi / t["comm_bwd"].median_ms]
            # the same from the best iterations (least disturbed by other load)
            summary["hidden_fraction_min"] = (t["tp_blocking"].min_ms - t["tp"].min_ms) / max(t["comm_bwd"].min_ms, 1e-9)
        else:
            summary["hidden_fraction"] = None
    if "tp" in t and "compute" in t:
        summary["exposed_comm_estimate_ms"] = t["tp"].median_ms - t["compute"].median_ms
    if measured is not None:
        summary.update(measured)
    for other in ("dense", "naive"):
        if "tp" in t and other in t:
            summary[f"speedup_vs_{other}"] = t[other].median_ms / t["tp"].median_ms
    return {
        "schema": SCHEMA,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()
                   if k not in ("progress", "trace_dir", "trace_iters")},
        "link": None if link is None else {"spec": link.spec, "bandwidth_gbps": link.bandwidth_gbps,
                                           "latency_us": link.latency_us, "emulated": True},
        "environment": _environment(tp, backend, cfg),
        "timings": {name: timing.as_dict() for name, timing in t.items()},
        "skipped": dict(skipped or {}),
        "summary": summary,
    }
