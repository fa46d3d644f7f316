"""The bench report tells one consistent story (issue 29): one headline (the overlapped step as a ratio of
the limit max(matmuls alone, collectives alone) and of the blocking schedule, each with an interval),
hidden fractions from one definition (comm accounting) in [0, 1], exposed <= step, every ratio the
ratio of the medians in the table; on CPU the default runs over a fixed emulated link; progress, the
estimate and --quick. Fast: synthetic reports and tiny runs (no speed is asserted)."""
import io
import json
import re
import statistics

import pytest

from tplayers.bench.config import BenchConfig
from tplayers.bench.report import summarize
from tplayers.bench.timing import Progress, Timing, estimate_line
from tplayers.cli import build_parser, main
from tplayers.cli.bench_cmd import bench_config
from tplayers.cli.bench_table import format_report

SCHEDULES = ("tp", "tp_blocking", "tp_split", "tp_chunked", "tp_cm")


def _fractions(node, path=""):
    """Every value under a key that names a fraction, anywhere in the report."""
    if isinstance(node, dict):
        for k, v in node.items():
            if "fraction" in k and not isinstance(v, (dict, list)):
                yield f"{path}.{k}", v
            else:
                yield from _fractions(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _fractions(v, f"{path}[{i}]")


def assert_report_invariants(report):
    """What every bench report must satisfy, whatever the machine's noise."""
    t, s = report["timings"], report["summary"]
    for where, value in _fractions(report):
        assert value is None or 0.0 <= value <= 1.0, f"{where} = {value} is not in [0, 1]"
    for name, sched in report["schedules"].items():
        step = t[name]["median_ms"]
        assert sched["step_ms"] == step, name
        assert 0.0 <= sched["exposed_comm_ms"] <= step, (name, sched["exposed_comm_ms"], step)
        assert 0.0 <= sched["exposed_comm_ms"] <= sched["comm_in_flight_ms"], name
        for phase in ("fwd", "bwd"):
            exposed, flight = sched[f"exposed_comm_{phase}_ms"], sched[f"comm_in_flight_{phase}_ms"]
            assert 0.0 <= exposed <= flight and exposed <= sched["exposed_comm_ms"], (name, phase)
        for what in ("exposed_comm", "comm_in_flight"):  # the phases add up to the total
            assert sched[f"{what}_ms"] == pytest.approx(sched[f"{what}_fwd_ms"] + sched[f"{what}_bwd_ms"]), (name, what)
        if sched["comm_in_flight_ms"] > 0:  # the one definition: 1 - exposed / in flight (medians)
            assert sched["hidden_fraction"] == pytest.approx(1 - sched["exposed_comm_ms"] / sched["comm_in_flight_ms"])
        if "comm" in t and "compute" in t:
            limit = max(t["comm"]["median_ms"], t["compute"]["median_ms"])
            assert sched["vs_limit"] == pytest.approx(step / limit)
            lo, hi = sched["vs_limit_ci"]
            assert lo <= sched["vs_limit"] <= hi
        if "tp_blocking" in t:
            assert sched["vs_blocking"] == pytest.approx(step / t["tp_blocking"]["median_ms"])
            lo, hi = sched["vs_blocking_ci"]
            assert lo <= sched["vs_blocking"] <= hi
    if "tp" in report["schedules"]:
        h = s["headline"]
        assert h["schedule"] == "tp" and h["step_ms"] == t["tp"]["median_ms"]
        for key in ("vs_limit", "vs_limit_ci", "vs_blocking", "vs_blocking_ci"):
            assert h.get(key) == report["schedules"]["tp"].get(key), key
        for key in ("exposed_comm_ms", "hidden_fraction", "forward_hidden_fraction", "backward_hidden_fraction"):
            assert s[key] == report["schedules"]["tp"][key], key
        assert s["exposed_comm_ms"] <= t["tp"]["median_ms"]
    for other in ("dense", "naive"):
        if "tp" in t and other in t:
            assert s[f"speedup_vs_{other}"] == pytest.approx(t[other]["median_ms"] / t["tp"]["median_ms"])
    table = format_report(report)
    assert "-0%" not in table and "nan" not in table.lower()
    for pct in (int(p) for p in re.findall(r"(-?\d+)%", table)):
        assert 0 <= pct <= 100, table


# ---------------------------------------------------------------------------- synthetic: adversarial noise


def _noisy_timings(n=41):
    """Overlap 'on' slower than 'off' in most iterations (the noise of a shared box), a spike or two."""
    tp = [0.100 + 0.004 * ((7 * i) % 5) for i in range(n)]
    return {
        "tp": Timing(tp, [i % 2 for i in range(n)]),
        "tp_blocking": Timing([x - 0.003 + (0.05 if i == 3 else 0.0) for i, x in enumerate(tp)], [0] * n),
        "tp_split": Timing([x - 0.010 for x in tp], [1] * n),
        "tp_cm": Timing([0.050 + 0.001 * (i % 7) for i in range(n)], [1] * n),  # shorter than its phases' medians
        "comm": Timing([0.080 + 0.001 * (i % 3) for i in range(n)], [0] * n),
        "comm_bwd": Timing([0.040] * n, [0] * n),
        "compute": Timing([0.020 + 0.002 * (i % 4) for i in range(n)], [1] * n),
        "dense": Timing([0.030] * n, [0] * n),
    }


def _noisy_accounting(n=41):
    """Per timed iteration (slowest rank): exposed fwd / bwd, in flight fwd / bwd (ms); some rows
    where the exposed time exceeds the time in flight or the step (clock noise) must not leak out."""
    rows = [[40.0, 10.0 + (i % 3), 40.0, 40.0 - (5.0 if i % 4 == 0 else 0.0)] for i in range(n)]
    rows[5] = [60.0, 70.0, 40.0, 40.0]  # exposed > in flight, exposed > the step
    counts = {"collectives_per_step": {"all_reduce/backward": 1, "all_reduce/forward": 1},
              "bytes_per_step": {"all_reduce/backward": 2 ** 21, "all_reduce/forward": 2 ** 21}}
    blocking = [[40.0, 40.0, 40.0, 40.0] for _ in range(n)]
    return {"tp": dict(rows=rows, **counts), "tp_blocking": dict(rows=blocking, **counts),
            "tp_split": dict(rows=[[40.0, 2.0, 40.0, 40.0]] * n, **counts),
            "tp_cm": dict(rows=[[40.0, 40.0, 40.0, 40.0]] * n, **counts)}


def test_invariants_hold_on_a_noisy_synthetic_report():
    cfg = BenchConfig(iters=41, modes=("tp", "tp_blocking", "tp_split", "tp_cm", "comm", "comm_bwd", "compute", "dense"))
    report = summarize(cfg, 2, _noisy_timings(), {}, backend="gloo", accounting=_noisy_accounting())
    assert_report_invariants(report)
    h = report["summary"]["headline"]
    assert h["limit_by"] == "comm" and h["vs_blocking"] > 1  # 'on' slower than 'off' here: said, not hidden
    assert report["schedules"]["tp_blocking"]["backward_hidden_fraction"] == 0.0
    assert report["schedules"]["tp_split"]["backward_hidden_fraction"] == pytest.approx(1 - 2 / 40)
    cm = report["schedules"]["tp_cm"]  # 80 ms blocked per step by the phases' medians, in a ~53 ms step: scaled down
    assert cm["exposed_comm_ms"] == pytest.approx(cm["step_ms"]) and cm["exposed_comm_fwd_ms"] == pytest.approx(cm["exposed_comm_bwd_ms"])
    json.dumps(report)  # JSON-able


def test_headline_interval_comes_from_paired_iterations_and_narrows_with_more():
    def run(n):
        t = {k: v for k, v in _noisy_timings(n).items() if k in ("tp", "tp_blocking", "comm", "compute")}
        return summarize(BenchConfig(iters=n), 2, t, {}, accounting=None)["summary"]["headline"]

    few, many, again = run(9), run(101), run(101)
    assert few["vs_limit_ci"][1] - few["vs_limit_ci"][0] >= many["vs_limit_ci"][1] - many["vs_limit_ci"][0]
    assert many == again  # a fixed seed: the same report from the same times
    t = _noisy_timings(101)
    assert many["vs_limit"] == pytest.approx(statistics.median(t["tp"].times) / statistics.median(t["comm"].times))


# ---------------------------------------------------------------------------- real tiny runs


def _tiny(capsys, *extra):
    rc = main(["bench", "--tp", "2", "--batch", "2", "--seq", "8", "--hidden", "8", "--ffn", "16", "--iters", "3",
               "--warmup", "1", "--json", "--no-progress", *extra])
    assert rc == 0
    return json.loads(capsys.readouterr().out)


def test_default_run_on_cpu_emulates_a_fixed_link_and_keeps_the_invariants(capsys):
    from tplayers.bench.link import DEFAULT_CPU_LINK, GPU_PEAK_TFLOPS, PRESETS, REFERENCE_TFLOPS

    report = _tiny(capsys)
    assert_report_invariants(report)
    link = report["link"]
    assert report["config"]["link"] == DEFAULT_CPU_LINK and report["config"]["default_link"] is True
    assert link["emulated"] and link["calibration"]["method"] == "fixed reference"
    assert link["bandwidth_gbps"] == pytest.approx(PRESETS["h100-nvlink"].bandwidth_gbps * REFERENCE_TFLOPS
                                                   / GPU_PEAK_TFLOPS["h100"])
    assert link["calibration"]["this_machine_tflops"] > 0  # recorded, not used
    assert set(report["schedules"]) == {"tp", "tp_blocking", "tp_split", "tp_chunked"}
    table = format_report(report)
    assert "EMULATED" in table and "cannot show" in table and "--link none" in table
    assert "headline:" in table and "x the limit" in table


def test_link_none_is_real_gloo_and_says_so(capsys):
    report = _tiny(capsys, "--link", "none", "--modes", "tp,tp_blocking,comm,compute")
    assert_report_invariants(report)
    assert report["link"] is None and report["config"]["link"] is None
    assert "REAL gloo" in format_report(report)


def test_match_at_a_stated_throughput_measures_nothing(monkeypatch):
    from tplayers.bench import link

    monkeypatch.setattr(link, "matmul_tflops", lambda *a, **k: pytest.fail("measured"))
    model = link.parse_link("match:pcie5@0.2")
    assert model.bandwidth_gbps == pytest.approx(64.0 * 0.2 / 989.0) and model.latency_us == 5.0
    assert model.scaled_for_tflops == 0.2 and not model.measured
    with pytest.raises(ValueError, match="TFLOP/s"):
        link.parse_link("match:pcie5@fast")


# ---------------------------------------------------------------------------- time: estimate, progress, --quick


def test_estimate_says_how_long_and_how_to_shorten():
    assert estimate_line(300.0, rounds=55, modes=9).startswith("about 5 min")
    assert "`--iters N` or `--quick` to shorten" in estimate_line(300.0, rounds=55, modes=9)
    assert "to shorten" not in estimate_line(8.0, rounds=4, modes=2) and "about 8 s" in estimate_line(8.0, 4, 2)


def test_progress_prints_whole_lines_when_stderr_is_not_a_terminal():
    out = io.StringIO()
    bar = Progress(20, "bench", True, stream=out, tty=False)
    for _ in range(20):
        bar.step()
    text = out.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert 2 <= len(lines) <= 11 and lines[-1].startswith("bench: 20/20")
    quiet = io.StringIO()
    Progress(5, "bench", False, stream=quiet, tty=False).step()
    assert quiet.getvalue() == ""


def test_quick_shortens_and_explicit_iters_win():
    parse = build_parser().parse_args
    assert (bench_config(parse(["bench", "--quick"]), 2).iters, bench_config(parse(["bench", "--quick"]), 2).warmup) == (10, 1)
    assert bench_config(parse(["bench", "--quick", "--iters", "7"]), 2).iters == 7
    assert (bench_config(parse(["bench"]), 2).iters, bench_config(parse(["bench"]), 2).warmup) == (50, 5)


def test_time_steps_says_how_long_first_then_progress_lines(capsys):
    """stderr not a terminal (CI, `2> log`; here captured): the estimate after the first round, then
    whole progress lines, no carriage returns. (The command turns this on by default: see above.)"""
    from tplayers.bench.timing import time_steps

    timings = time_steps({"a": lambda: None, "b": lambda: None}, group=None, iters=4, warmup=1, progress=True,
                         label="bench mlp tp=1")
    assert [len(t.times) for t in timings.values()] == [4, 4] and timings["a"].ranks == [0] * 4
    err = capsys.readouterr().err
    assert "\r" not in err, err
    lines = err.splitlines()
    assert lines[0] == "bench mlp tp=1: 2 modes x (1 warm-up + 4 timed) rounds; timing the first round ..."
    assert lines[1].startswith("bench mlp tp=1: about 0 s (5 rounds of 2 modes, from the first round)")
    assert lines[-1].startswith("bench mlp tp=1: 5/5 rounds")
    assert bench_config(build_parser().parse_args(["bench"]), 2).progress  # on by default, whatever stderr is
