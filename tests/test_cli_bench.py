"""The ``tplayers bench`` command: its JSON schema and table, each mode, the emulated link, --simulate, --trace."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env

from tplayers.bench import MODES, SCHEMA
from tplayers.cli import main
from tplayers.cli.bench_table import format_report, plot_report


def test_bench_json_schema_and_table(capsys, tmp_path):
    rc = main(["bench", "--tp", "2", "--batch", "1", "--seq", "8", "--hidden", "8", "--ffn", "16",
               "--iters", "3", "--warmup", "1", "--json", "--no-progress", "--save", str(tmp_path / "b.json")])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out)
    assert report == json.loads((tmp_path / "b.json").read_text())
    assert report["schema"] == SCHEMA
    assert report["config"]["hidden"] == 8 and report["config"]["iters"] == 3
    assert report["environment"]["tp"] == 2 and report["environment"]["backend"] == "gloo"
    assert set(report["timings"]) == set(MODES) - {"tp_chunked", "tp_cm"}  # naive runs at TP 2
    assert "need --batch >= 2" in report["skipped"]["tp_chunked"]  # a batch of 1 has nothing to chunk
    for timing in report["timings"].values():
        assert set(timing) == {"min_ms", "median_ms", "mean_ms", "n"} and timing["n"] == 3
        assert 0 < timing["min_ms"] <= timing["median_ms"]
    s = report["summary"]
    assert {"headline", "hidden_fraction", "forward_hidden_fraction", "backward_hidden_fraction", "exposed_comm_ms",
            "comm_in_flight_ms", "speedup_vs_dense", "speedup_vs_naive"} <= set(s)
    h = s["headline"]
    assert {"step_ms", "limit_ms", "limit_by", "vs_limit", "vs_limit_ci", "vs_blocking", "vs_blocking_ci",
            "within_noise"} <= set(h)
    lo, hi = h["vs_blocking_ci"]
    assert lo <= h["vs_blocking"] <= hi and h["within_noise"] == (lo <= 1 <= hi)
    assert set(report["schedules"]) == {"tp", "tp_blocking", "tp_split"}
    table = format_report(report)
    assert "TP fwd+bwd, overlap on" in table and "headline: the overlapped step" in table
    assert "95% interval" in table and (("WITHIN NOISE" in table) == h["within_noise"])
    if _has_matplotlib():
        plot_report(report, str(tmp_path / "b.png"))
        assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_median_interval_brackets_the_median_and_narrows_with_n():
    from tplayers.bench.report import median_interval

    assert median_interval([3.0]) == (3.0, 3.0)
    assert median_interval([5.0, 1.0, 3.0]) == (1.0, 5.0)  # too few values: the whole range
    wide = median_interval([float(i) for i in range(10)])
    narrow = median_interval([float(i % 10) for i in range(1000)])
    assert wide[0] <= 4.5 <= wide[1] and narrow[0] <= 4.5 <= narrow[1]
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
    # n = 100: k = floor(50 - 9.8) = 40, the 41st and 60th values (the textbook 95% interval)
    assert median_interval([float(i) for i in range(100)]) == (40.0, 59.0)


def test_bench_tp1_column_skips_naive(capsys):
    rc = main(["bench", "--tp", "1", "--module", "column", "--batch", "1", "--seq", "4", "--hidden", "8",
               "--iters", "2", "--warmup", "0", "--modes", "tp,dense,naive,comm_bwd,tp_blocking", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "skipped" in out and "needs --tp 2" in out
    assert "no collective at TP 1" in out


def test_bench_split_backward_mode_reports_its_own_accounting(capsys):
    for module in ("mlp", "block"):
        rc = main(["bench", "--tp", "2", "--module", module, "--batch", "1", "--seq", "8", "--hidden", "16", "--heads",
                   "2", "--iters", "1", "--warmup", "0", "--modes", "tp,tp_split,comm_bwd", "--json", "--no-progress"])
        report = json.loads(capsys.readouterr().out)
        assert rc == 0 and "tp_split" in report["timings"]
        split = report["schedules"]["tp_split"]
        assert split["collectives_per_step"] == report["summary"]["collectives_per_step"]  # the same collectives
        assert 0.0 <= split["exposed_comm_ms"] and 0.0 <= split["backward_hidden_fraction"] <= 1.0
    rc = main(["bench", "--tp", "2", "--module", "column", "--batch", "1", "--seq", "4", "--hidden", "8", "--ffn", "8",
               "--iters", "1", "--warmup", "0", "--modes", "tp,tp_split", "--json", "--no-progress"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and "split backward needs a column and a row layer" in report["skipped"]["tp_split"]


def test_bench_chunked_mode_runs_one_collective_per_chunk(capsys):
    for module in ("mlp", "block"):
        rc = main(["bench", "--tp", "2", "--module", module, "--batch", "5", "--seq", "4", "--hidden", "16", "--heads",
                   "2", "--iters", "1", "--warmup", "0", "--modes", "tp,tp_chunked", "--chunks", "3", "--json",
                   "--no-progress"])
        report = json.loads(capsys.readouterr().out)
        assert rc == 0 and "tp_chunked" in report["timings"]
        chunked, plain = report["schedules"]["tp_chunked"], report["summary"]["collectives_per_step"]
        assert chunked["chunks"] == 3
        assert chunked["collectives_per_step"]["all_reduce/forward"] == 3 * plain["all_reduce/forward"]
        assert 0.0 <= chunked["forward_hidden_fraction"] <= 1.0
        assert "split bwd + batch chunks, k=3" in format_report(report)
        assert set(report["timeline"]) == {"tp", "tp_chunked"}
    with pytest.raises(SystemExit):
        main(["bench", "--chunks", "0"])


def test_bench_collective_matmul_mode_moves_the_forward_in_ring_steps(capsys):
    rc = main(["bench", "--tp", "2", "--module", "mlp", "--sequence-parallel", "--batch", "2", "--seq", "8", "--hidden",
               "16", "--iters", "1", "--warmup", "0", "--modes", "tp,tp_cm", "--json", "--no-progress"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and "tp_cm" in report["timings"]
    cm, plain = report["schedules"]["tp_cm"]["collectives_per_step"], report["summary"]["collectives_per_step"]
    assert "all_gather/forward" in plain and "all_gather/forward" not in cm and cm["send/forward"] == 2  # p-1 each
    assert "collective matmul (SP)" in format_report(report)


def test_bench_block_overlap_on_off_dense_and_sequence_parallel(capsys):
    rc = main(["bench", "--tp", "2", "--module", "block", "--batch", "1", "--seq", "8", "--hidden", "16",
               "--heads", "2", "--iters", "2", "--warmup", "1", "--json", "--no-progress"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["config"]["module"] == "block" and report["config"]["heads"] == 2
    assert set(report["timings"]) == set(MODES) - {"naive", "tp_chunked", "tp_cm"} and "naive" in report["skipped"]
    assert report["summary"]["hidden_fraction"] is not None and "speedup_vs_dense" in report["summary"]
    rc = main(["bench", "--tp", "2", "--module", "block", "--sequence-parallel", "--batch", "1", "--seq", "8",
               "--hidden", "16", "--heads", "2", "--iters", "1", "--warmup", "0", "--modes", "tp,tp_blocking,comm_bwd",
               "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "block sequence-parallel" in out and "heads=2" in out


@pytest.mark.parametrize("sp, expect_all, expect_bwd", [
    (False, ["ar"] * 4, ["ar"] * 2),  # 2 row forward all-reduces; qkv and fc1 input-grad all-reduces
    (True, ["ag", "rs", "ag", "rs", "ag", "ag", "rs", "norm", "norm", "ag", "ag", "rs", "norm", "norm"], ["ag", "rs"] * 2),
])
def test_bench_block_collectives_alone(monkeypatch, sp, expect_all, expect_bwd):
    """The block's comm modes replay what its overlapped step issues, on (b, s, h) activations (and,
    under sequence parallelism, the norm-weight gradient all-reduces: h values each); comm_bwd: the
    input-gradient collectives of qkv and fc1 (under SP: the re-gather of x and the reduce-scatter)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tplayers.bench.config import BenchConfig
    from tplayers.bench.overlap import BenchInputs
    from tplayers.bench.accounting import comm_accounting
    from tplayers.core.groups import resolve_group

    act = 1 * 8 * 16 * 4  # (b, s, h) float32
    names = {("all_reduce", act): "ar", ("all_gather", act): "ag", ("reduce_scatter", act): "rs",
             ("all_reduce", 16 * 4): "norm"}
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)  # one simulated rank of 2
    try:
        cfg = BenchConfig(module="block", batch=1, seq=8, hidden=16, ffn=32, heads=2, sequence_parallel=sp)
        everything, bwd = BenchInputs.create(resolve_group(dist.group.WORLD), cfg).comm
        for step, expected in ((everything, expect_all), (bwd, expect_bwd)):
            with comm_accounting() as acct:
                step()
            assert [names[r.op, r.nbytes] for r in acct.records] == expected
    finally:
        dist.destroy_process_group()


def test_bench_emulated_link_json_keys(capsys):
    rc = main(["bench", "--tp", "2", "--batch", "1", "--seq", "8", "--hidden", "8", "--ffn", "16", "--iters", "3",
               "--warmup", "1", "--json", "--no-progress", "--link", "0.5/10"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["link"] == "0.5/10"  # the spec as given
    assert report["link"] == {"spec": "0.5/10", "bandwidth_gbps": 0.5, "latency_us": 10.0, "emulated": True,
                              "calibration": {"method": "given"}}
    assert report["config"]["default_link"] is False
    s = report["summary"]
    for key in ("hidden_fraction", "forward_hidden_fraction", "backward_hidden_fraction", "exposed_comm_ms",
                "exposed_comm_fwd_ms", "exposed_comm_bwd_ms", "comm_in_flight_ms"):
        assert isinstance(s[key], float), key
    assert s["forward_hidden_fraction"] < 0.05  # the forward all-reduce blocks: nothing hides it
    for mode in ("tp", "tp_blocking"):  # one step's intervals, for the timeline plot
        tl = report["timeline"][mode]
        assert [(c["op"], c["phase"]) for c in tl["collectives"]] == [("all_reduce", "forward"), ("all_reduce", "backward")]
        assert all(0 <= c["launch_ms"] <= c["wait_ms"] <= c["end_ms"] <= tl["step_ms"] for c in tl["collectives"])
    # Column -> GELU -> Row MLP without SP: one all-reduce forward (fc2), one backward (fc1), (1, 8, 8) float32
    assert s["collectives_per_step"] == {"all_reduce/backward": 1, "all_reduce/forward": 1}
    assert s["bytes_per_step"] == {"all_reduce/backward": 256, "all_reduce/forward": 256}
    # 256 bytes at 0.5 GB/s on 2 ranks: 0.5 us of bandwidth + 2 x 10 us of latency per all-reduce, all blocked on
    assert s["exposed_comm_fwd_ms"] >= 0.0205


def test_bench_trace_writes_one_trace_per_rank_without_profiler_noise(tmp_path):
    """The profiler's C++ side printed 'USDT: ... profiler_start' lines on stderr; they are kept out."""
    proc = subprocess.run([sys.executable, "-m", "tplayers", "bench", "--tp", "2", "--batch", "1", "--seq", "8",
                           "--hidden", "8", "--ffn", "16", "--iters", "2", "--warmup", "1", "--no-progress",
                           "--trace", str(tmp_path / "tr")], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr
    assert sorted(p.name for p in (tmp_path / "tr").iterdir()) == ["bench_trace_rank0.json", "bench_trace_rank1.json"]
    assert "profiler trace (rank 0)" in proc.stdout


def _simulated(capsys, tp):
    rc = main(["bench", "--simulate", "--tp", str(tp), "--module", "block", "--batch", "2", "--seq", "16",
               "--hidden", "32", "--ffn", "64", "--heads", "8", "--iters", "2", "--warmup", "1", "--json",
               "--no-progress", "--link", "1/5"])
    assert rc == 0
    return json.loads(capsys.readouterr().out)


def test_bench_simulate_any_tp_size_in_one_process(capsys):
    """--simulate: one rank of TP 1, 2 or 8 on a fake process group, collectives timed by the link."""
    reports = {tp: _simulated(capsys, tp) for tp in (1, 2, 8)}
    for tp, report in reports.items():
        assert report["simulation"]["tp"] == tp and report["environment"]["backend"] == "fake (simulated)"
        assert report["config"]["link"] == "1/5" and report["summary"]["step_ms"] > 0
        assert "dense" not in report["timings"] and "naive" not in report["timings"]
    act = 2 * 16 * 32 * 4  # one (b, s, h) float32 activation
    for tp in (2, 8):  # the block's textbook collectives, whatever the TP size
        s = reports[tp]["summary"]
        assert s["collectives_per_step"] == {"all_reduce/backward": 2, "all_reduce/forward": 2}
        assert s["bytes_per_step"] == {"all_reduce/backward": 2 * act, "all_reduce/forward": 2 * act}
        # each all-reduce blocks at least its latency term 2 (p-1) x 5 us in forward (no overlap there)
        assert s["exposed_comm_fwd_ms"] >= 2 * 2 * (tp - 1) * 5e-3
    params = [reports[tp]["simulation"]["param_bytes"] for tp in (1, 2, 8)]
    assert params[0] > params[1] > params[2]  # sharded weights shrink with TP; norms stay replicated
    assert "collectives_per_step" not in reports[1]["summary"]  # TP 1: no collectives at all


def test_bench_simulate_needs_no_launcher_and_refuses_bad_input(capsys):
    assert main(["bench", "--simulate", "--tp", "3", "--iters", "1"]) == 2  # ffn 256 does not split in 3
    assert "not divisible by the TP degree 3" in capsys.readouterr().err
    assert main(["bench", "--shape", "llama3-8b", "--module", "mlp"]) == 2
    assert "--shape llama3-8b is a transformer layer" in capsys.readouterr().err


def _processes_with(marker: str) -> list:
    """PIDs of live processes whose environment carries ``marker`` (the run, its forkserver, its ranks)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() in f.read():
                    with open(f"/proc/{entry}/stat") as s:
                        if s.read().split(") ", 1)[1].startswith("Z"):  # a zombie is gone, not yet reaped
                            continue
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:100]
        with open(f"/proc/{pid}/status") as f:
            status = {k: v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}
        tasks = os.listdir(f"/proc/{pid}/task")
        wchan = [open(f"/proc/{pid}/task/{t}/wchan").read() for t in tasks]
        return f"{cmd} ppid={status.get('PPid')} state={status.get('State')} threads={len(tasks)} wchan={wchan}"
    except OSError:
        return "?"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_sigterm_ends_the_bench_its_forkserver_and_ranks_within_seconds():
    """SIGTERM (timeout(1), CI cancellation) to `tplayers bench` mid-run: before, the main process
    died and the forkserver and ranks ran on until their work ended (holding GPU memory on a GPU
    box). Now the command handles SIGTERM as Ctrl-C, and ranks whose parent is gone exit at once."""
    import signal
    import subprocess
    import sys
    import time
    import uuid

    marker = f"TPLAYERS_SIGTERM_TEST={uuid.uuid4().hex}"
    env = dict(subprocess_env(), **dict([marker.split("=")]))
    proc = subprocess.Popen([sys.executable, "-m", "tplayers", "bench", "--shape", "large", "--iters", "100000",
                             "--modes", "tp", "--no-progress"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        # main, resource tracker, forkserver, 2 ranks; then the ranks are timing (the case of the issue:
        # a signal mid-run; one landing inside the ranks' rendezvous is not covered, see docs/checks.md)
        while len(_processes_with(marker)) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(4)
        assert len(_processes_with(marker)) >= 5
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: _cmdline(pid) for pid in _processes_with(marker)}
        assert not left, f"still running 5 s after SIGTERM: {left}; rc {proc.returncode}: {proc.stderr.read()[-1500:]}"
    finally:
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
