"""``tplayers bench``'s table and plot of an overlap report (the report itself: :mod:`tplayers.bench.report`)."""
from __future__ import annotations

from typing import Any, Dict, List

from ..bench.overlap import MODE_LABELS

__all__ = ["format_report", "format_prediction", "plot_report"]


def _ms(x: float) -> str:
    return f"{x:9.3f}"


def format_report(report: Dict[str, Any]) -> str:
    """The human-readable table of a bench report (as returned by run_overlap_bench)."""
    return "\n".join(_timings_lines(report) + _headline_lines(report) + _schedule_lines(report)
                     + _counts_lines(report) + _comparison_lines(report))


def format_prediction(report: Dict[str, Any]) -> str:
    """``--simulate --predict``'s table: each mode's PREDICTED step and where its time goes (tplayers.bench.predict)."""
    p, c = report["prediction"], report["config"]
    gpu, link = p["gpu"], p["link"]
    lines = [f"PREDICTION, not a measurement: one rank of TP {report['tp']} on an {gpu['name'].upper()} (GEMMs "
             f"{gpu['gemm_tflops']:g} TFLOP/s, attention {gpu['attention_tflops']:g}, memory {gpu['memory_gbps']:g} GB/s, "
             f"{gpu['kernel_us']:g} us a kernel; the host {gpu['host_us']:g} us an op, {gpu['collective_host_us']:g} us a "
             f"collective), link {link['bandwidth_gbps']:g} GB/s + {link['latency_us']:g} us a step",
             f"{c['module']} (b, s, h) = ({c['batch']}, {c['seq']}, {c['hidden']}), ffn {c['ffn']}, {c['dtype']}"
             f"{', sequence parallel' if c['sequence_parallel'] else ''}; the step recorded on the meta device", ""]
    w = max(40, *(len(MODE_LABELS.get(m, m)) for m in p["modes"]))
    cols = ("gemm_ms", "attention_ms", "memory_ms", "overhead_ms", "stream_waits_ms", "host_bound_ms", "host_ms")
    names = ("GEMM", "attn", "memory", "launch", "waits", "host-bnd", "host")
    lines.append(f"{'mode':<{w}} {'step ms':>8} {'x limit':>7} " + " ".join(f"{n:>8}" for n in names))
    lines.append(f"{'-' * w} {'-' * 8} {'-' * 7} " + " ".join("-" * 8 for _ in names))
    for mode, m in p["modes"].items():
        ratio = f"{m['vs_limit']:.2f}x" if "vs_limit" in m else "-"
        lines.append(f"{MODE_LABELS.get(mode, mode):<{w}} {m['step_ms']:8.3f} {ratio:>7} "
                     + " ".join(f"{m[k]:8.3f}" for k in cols))
    lines.append("the compute stream's time: GEMM, attention, memory-bound kernels, per-kernel launch floors, held by "
                 "collective waits, idle for want of issued work (host-bnd); host: the host's time issuing the step")
    for mode, why in report.get("skipped", {}).items():
        lines.append(f"{mode}: skipped ({why})")
    return "\n".join(lines) + "\n"


def _counts_lines(report: Dict[str, Any]) -> List[str]:
    """What a GPU pays per step beside the collectives (tplayers.bench.counts), each mode against the matmuls alone."""
    counts = report.get("counts") or {}
    if not counts:
        return []
    base = counts.get("compute")
    title = "per step (one steady-state step, this rank)"
    w = max(len(title), *(len(MODE_LABELS.get(m, m)) for m in counts))
    lines = [f"{title:<{w}} {'kernels':>8} {'moved MB':>9} {'GEMM GFLOP':>10} "
             f"{'host syncs':>10} {'collectives':>11}",
             f"{'-' * w} {'-' * 8} {'-' * 9} {'-' * 10} {'-' * 10} {'-' * 11}"]
    for mode, c in counts.items():
        lines.append(f"{MODE_LABELS.get(mode, mode):<{w}} {c['kernels']:>8} {c['moved_bytes'] / 1e6:>9.2f} "
                     f"{c['gemm_flops'] / 1e9:>10.3f} {c['host_syncs']:>10} {sum(c['collectives'].values()):>11}")
    if base is not None:
        lines.append(f"kernels: ops that launch work (views and allocations excluded); moved: bytes written by copies, "
                     f"concatenations, casts, fills; the matmuls alone launch {base['kernels']} kernels and move "
                     f"{base['moved_bytes'] / 1e6:.2f} MB")
    lines.append("")
    return lines


def _link_lines(report: Dict[str, Any]) -> List[str]:
    """Which wire the collectives ran over, and why (the CPU default says so)."""
    c, env, link = report["config"], report["environment"], report.get("link")
    if link is None:
        if env["device"] == "cpu" and env["tp"] > 1:
            return ["REAL gloo on shared CPU cores (--link none): its collectives are CPU work competing with the "
                    "matmuls for the same cores, so overlap cannot show here; these figures describe this machine only"]
        return []
    cal = link.get("calibration") or {}
    line = f"EMULATED link {link['spec']}: {link['bandwidth_gbps']:.4g} GB/s per direction, {link['latency_us']:.3g} us per step"
    if "preset" in cal:
        how = ("fixed, measured nothing" if cal["method"] == "fixed reference" else
               "measured on this machine at the start of the run: moves with its load")
        line += (f" = {cal['preset']} ({cal['preset_bandwidth_gbps']:g} GB/s) x {cal['scaled_for_tflops']:.3g} / "
                 f"{cal['gpu_peak_tflops']:g} TFLOP/s ({how})")
    lines = [line]
    if "reference" in cal:
        mine = cal.get("this_machine_tflops")
        lines.append(f"  calibration: {cal['reference']}" + ("" if mine is None else
                                                             f"; this machine: {mine:.3g} TFLOP/s per rank"))
    if c.get("default_link") and not report.get("simulation"):
        lines.append("  (the default on CPU: real gloo on shared CPU cores cannot show overlap, its collectives "
                     "compete with the matmuls for the same cores; --link none for real gloo)")
    return lines


def _timings_lines(report: Dict[str, Any]) -> List[str]:
    """The heading (module, shape, where it ran, the link) and one row per mode, timed or skipped."""
    c, env, t = report["config"], report["environment"], report["timings"]
    shape = f"[b, s, h]=[{c['batch']}, {c['seq']}, {c['hidden']}] ffn={c['ffn']}"
    if c["module"] == "block":
        shape += f" heads={c['heads']}"
    sp = " sequence-parallel" if c["sequence_parallel"] else ""
    load = env.get("load_average_1m")
    lines = [
        f"tplayers bench: {c['module']}{sp}  {shape}  tp={env['tp']}  {c['dtype']}  "
        f"{env['device']}/{env['backend']}  threads/rank={env['threads_per_rank']}",
        *_link_lines(report),
        f"{c['iters']} iterations (+{c['warmup']} warm-up) per mode, interleaved; "
        "time = slowest rank of each iteration" + ("" if load is None else f"; load average {load:.1f}"),
        "",
        f"{'mode':<40} {'min ms':>9} {'median ms':>9}",
        f"{'-' * 40} {'-' * 9} {'-' * 9}",
    ]
    for mode, timing in t.items():
        lines.append(f"{MODE_LABELS.get(mode, mode):<40} {_ms(timing['min_ms'])} {_ms(timing['median_ms'])}")
    for mode, why in report.get("skipped", {}).items():
        lines.append(f"{MODE_LABELS.get(mode, mode):<40} {'skipped':>9}  ({why})")
    lines.append("")
    return lines


def _ratio(value: Any, ci: Any) -> str:
    return "-" if value is None else f"{value:.2f}x ({ci[0]:.2f} .. {ci[1]:.2f})"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v + 0.0:.0f}%"


def _headline_lines(report: Dict[str, Any]) -> List[str]:
    """The one headline: the overlapped step against the limit and against the blocking schedule."""
    h = report["summary"].get("headline")
    if h is None:
        return []
    parts = []
    if "vs_limit" in h:
        by = "collectives alone" if h["limit_by"] == "comm" else "matmuls alone"
        lo, hi = h["vs_limit_ci"]
        parts.append(f"{h['vs_limit']:.2f}x the limit max(matmuls alone, collectives alone) = {h['limit_ms']:.3f} ms "
                     f"({by}); 95% interval {lo:.2f} .. {hi:.2f}")
    if "vs_blocking" in h:
        lo, hi = h["vs_blocking_ci"]
        parts.append(f"{h['vs_blocking']:.2f}x the blocking schedule (overlap off), {h['blocking_ms']:.3f} ms; "
                     f"95% interval {lo:.2f} .. {hi:.2f}")
    if not parts:
        return ["headline: add the modes comm, compute and tp_blocking for the overlapped step's ratios", ""]
    lines = [f"headline: the overlapped step (overlap on), {h['step_ms']:.3f} ms, takes"] + [f"  {p}" for p in parts]
    if h.get("within_noise"):
        lines.append("  WITHIN NOISE: the interval against the blocking schedule holds 1: this run cannot tell overlap "
                     "on from off (more --iters, a quieter machine)")
    lines.append("")
    return lines


def _schedule_lines(report: Dict[str, Any]) -> List[str]:
    """Every TP schedule: its step against the limit and the blocking step, and how much of its
    communication hid (one definition: comm accounting of the timed iterations)."""
    sched = report.get("schedules") or {}
    if not sched:
        return []
    labels = {mode: MODE_LABELS.get(mode, mode) + (f", k={m['chunks']}" if "chunks" in m else "")
              for mode, m in sched.items()}
    w = max(40, *(len(label) for label in labels.values()))
    lines = [f"{'schedule':<{w}} {'step ms':>9}  {'x limit (95%)':<21} {'x blocking (95%)':<21} "
             f"{'hidden: all':>11} {'fwd':>4} {'bwd':>4} {'exposed ms':>10}",
             f"{'-' * w} {'-' * 9}  {'-' * 21} {'-' * 21} {'-' * 11} {'-' * 4} {'-' * 4} {'-' * 10}"]
    for mode, m in sched.items():
        vs_blocking = "1 (itself)" if mode == "tp_blocking" else _ratio(m.get("vs_blocking"), m.get("vs_blocking_ci"))
        exposed = "-" if "exposed_comm_ms" not in m else f"{m['exposed_comm_ms']:.3f}"
        lines.append(f"{labels[mode]:<{w}} {_ms(m['step_ms'])}  {_ratio(m.get('vs_limit'), m.get('vs_limit_ci')):<21} "
                     f"{vs_blocking:<21} {_pct(m.get('hidden_fraction')):>11} {_pct(m.get('forward_hidden_fraction')):>4} "
                     f"{_pct(m.get('backward_hidden_fraction')):>4} {exposed:>10}")
    tp = sched.get("tp", {})
    if report["environment"]["tp"] == 1:
        lines.append("no collective at TP 1: nothing to hide")
    lines.append("hidden = 1 - (time blocked on the step's collectives) / (their time in flight), from comm accounting of "
                 "every timed iteration (slowest rank), medians")
    if "exposed_comm_ms" in tp and tp["comm_in_flight_ms"] > 0:
        lines.append(f"overlap on: {tp['exposed_comm_ms']:.3f} ms of its {tp['step_ms']:.3f} ms step blocked on "
                     f"collectives (forward {tp['exposed_comm_fwd_ms']:.3f}, backward {tp['exposed_comm_bwd_ms']:.3f}), "
                     f"of {tp['comm_in_flight_ms']:.3f} ms in flight")
    lines.append("")
    return lines


def _comparison_lines(report: Dict[str, Any]) -> List[str]:
    """TP against dense and naive, the collectives per step, the simulation, the trace."""
    s = report["summary"]
    lines = []
    for other, label in (("dense", "dense torch.nn"), ("naive", "naive model parallel")):
        key = f"speedup_vs_{other}"
        if key in s:
            ratio = s[key]  # median time of `other` / median time of TP
            verdict = f"{ratio:.3f}x faster" if ratio >= 1 else f"{1 / ratio:.3f}x slower"
            lines.append(f"TP (overlap on) vs {label}: {verdict} (median)")
    if "collectives_per_step" in s:
        per = ", ".join(f"{n} x {k} ({s['bytes_per_step'][k] / 1e6:.3g} MB)" for k, n in s["collectives_per_step"].items())
        lines.append(f"collectives per overlapped step: {per}")
    sim = report.get("simulation")
    if sim is not None:
        lines.append(f"SIMULATED: one rank of TP {sim['tp']} in one process ({sim['note']}); step "
                     f"{s.get('step_ms', float('nan')):.3f} ms; per rank: parameters {sim['param_bytes'] / 2**20:.2f} MiB, "
                     f"saved activations {sim['activation_bytes'] / 2**20:.2f} MiB")
    if "trace" in report:
        lines.append(f"profiler trace (rank 0): {report['trace']}  (open in chrome://tracing or ui.perfetto.dev)")
    return lines


def plot_report(report: Dict[str, Any], path: str) -> None:
    """A PNG: the medians as bars (min as a tick) and, when the report has them, one step's timeline
    with overlap on and off (rank 0: compute, time blocked on collectives, collectives in flight).
    Needs matplotlib (``pip install tplayers[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the optional extra
        raise SystemExit("tplayers bench --plot needs matplotlib: pip install 'tplayers[plot]'") from e
    timeline = report.get("timeline") or {}
    rows = len(report["timings"]) * 0.45 + 2.0
    lanes = 0.75 * len(timeline) + 1.4
    fig, axes = plt.subplots(2 if timeline else 1, 1, figsize=(9, rows + (lanes if timeline else 0)), squeeze=False,
                             gridspec_kw={"height_ratios": [rows, lanes]} if timeline else None)
    _bars(axes[0][0], report)
    if timeline:
        _timeline(axes[1][0], timeline)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bars(ax: Any, report: Dict[str, Any]) -> None:
    c, env, t, s = report["config"], report["environment"], report["timings"], report["summary"]
    modes = list(t)
    labels = [MODE_LABELS.get(m, m) for m in modes]
    med = [t[m]["median_ms"] for m in modes]
    mins = [t[m]["min_ms"] for m in modes]
    y = list(range(len(modes)))
    kind = ["tp" if m.startswith("tp") else "comm" if m.startswith("comm") else "other" for m in modes]
    references = ", ".join(MODE_LABELS.get(m, m).split(" (")[0].split(",")[0] for m, k in zip(modes, kind) if k == "other")
    kinds = {"tp": ("C0", "TP forward+backward"), "comm": ("C7", "collectives alone"),
             "other": ("C2", f"references ({references})")}
    ax.barh(y, med, color=[kinds[k][0] for k in kind])
    for k, (color, label) in kinds.items():  # one legend entry per colour used
        if k in kind:
            ax.barh([0], [0], color=color, label=f"{label} (median)")
    ax.scatter(mins, y, color="k", marker="|", s=200, label="min", zorder=3)
    ax.set_yticks(y)
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms per forward+backward (median; | = min), slowest rank")
    h = s.get("headline") or {}
    found = [f"{h['vs_limit']:.2f}x the limit max(matmuls, collectives alone)"] if "vs_limit" in h else []
    found += [f"{h['vs_blocking']:.2f}x overlap off"] if "vs_blocking" in h else []
    if s.get("hidden_fraction") is not None:
        found.append(f"{_pct(s['hidden_fraction'])} of its communication hidden")
    link = report.get("link")
    wire = "" if link is None else f", EMULATED link {link['spec']} ({link['bandwidth_gbps']:.3g} GB/s)"
    title = (f"{c['module']} b={c['batch']} s={c['seq']} h={c['hidden']} ffn={c['ffn']} "
             f"tp={env['tp']} {env['device']}/{env['backend']}{wire}")
    if found:
        title += "\noverlap on: " + ", ".join(found)
    ax.set_title(title, fontsize=8)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.11), fontsize=7, ncol=2, frameon=False)


def _timeline(ax: Any, timeline: Dict[str, Any]) -> None:
    """Per mode two lanes: rank 0's compute (green) with the time it was blocked on collectives (red),
    and the collectives in flight from launch to completion (grey: forward dark, backward light)."""
    lanes = []
    for i, (mode, tl) in enumerate(timeline.items()):
        top, bottom = 3 * i, 3 * i + 1  # compute lane, link lane
        ax.broken_barh([(0, tl["step_ms"])], (top, 0.8), color="C2")
        for r in tl["collectives"]:
            if r["end_ms"] is None:
                continue
            color = "0.35" if r["phase"] == "forward" else "0.7"
            ax.broken_barh([(r["launch_ms"], r["end_ms"] - r["launch_ms"])], (bottom, 0.8), color=color)
            if r["wait_ms"] is not None and r["end_ms"] > r["wait_ms"]:
                ax.broken_barh([(r["wait_ms"], r["end_ms"] - r["wait_ms"])], (top, 0.8), color="C3")
        lanes += [(top + 0.4, f"{MODE_LABELS.get(mode, mode)}: rank 0"), (bottom + 0.4, "collectives in flight")]
    ax.set_yticks([y for y, _ in lanes])
    ax.set_yticklabels([label for _, label in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms into one step (rank 0)")
    records = [r for tl in timeline.values() for r in tl["collectives"] if r["end_ms"] is not None]
    used = {"C2": True, "C3": any(r["wait_ms"] is not None and r["end_ms"] > r["wait_ms"] for r in records),
            "0.35": any(r["phase"] == "forward" for r in records), "0.7": any(r["phase"] != "forward" for r in records)}
    for color, label in (("C2", "computing"), ("C3", "blocked on a collective (exposed)"),
                         ("0.35", "forward collective"), ("0.7", "backward collective")):
        if used[color]:  # a legend entry only for what the plot shows
            ax.broken_barh([(0, 0)], (0, 0), color=color, label=label)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=7, ncol=4, frameon=False)
