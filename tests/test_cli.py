"""The ``tplayers`` command: verify (table, exit status, torchrun) and bench (JSON schema, table)."""
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tplayers.bench import MODES, SCHEMA
from tplayers.cli import main
from tplayers.cli import checks as C
from tplayers.cli import verify as V
from tplayers.cli.bench_cmd import format_report, plot_report
from tplayers.layers import ColumnParallelLinear, RowParallelLinear
from tplayers.testing import get_world

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    return env


# ---------------------------------------------------------------------------- verify


def test_verify_in_process_tp1_and_2(capsys):
    rc = main(["verify", "--tp", "1,2", "-k", "RowParallelLinear", "-k", "MLP(sequence"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith("tplayers verify: 4 checks x 2 TP sizes = 8, dtype=float64"), out  # what the footer counts
    rows = [line for line in out.splitlines() if line.startswith(("RowParallelLinear", "Column->GELU"))]
    assert len(rows) == 2 * 4, out  # 3 row variants + the SP MLP, at TP 1 and 2
    for line in rows:
        name, tp, fwd, grad, result = line.rsplit(None, 4)
        assert tp in ("1", "2") and result == "PASS"
        assert float(fwd) < 1e-9 and float(grad) < 1e-9  # float64 by default
    assert "8/8 checks passed" in out


def test_verify_checks_your_own_model_and_plan(capsys, monkeypatch):
    """--model / --plan: examples/own_model.py's right plan passes at TP 1 and 2, its wrong one (the fused
    c_attn as a plain column) fails with the audit's cause. Imported from the working directory."""
    monkeypatch.chdir(ROOT)
    rc = main(["verify", "--tp", "1,2", "--model", "examples.own_model:build", "--plan", "examples.own_model:PLAN"])
    out = capsys.readouterr().out
    assert rc == 0 and "2/2 checks passed" in out, out
    rc = main(["verify", "--tp", "2", "--model", "examples.own_model:build", "--plan", "examples.own_model:WRONG_PLAN"])
    out = capsys.readouterr().out
    assert rc == 1 and "AuditError" in out and "looks fused" in out and "likely cause" in out, out
    assert main(["verify", "--plan", "examples.own_model:PLAN"]) == 2  # --plan without --model
    rc = main(["verify", "--tp", "1", "--model", "examples.own_model:missing"])
    assert rc == 1 and "has no 'missing'" in capsys.readouterr().out


def test_verify_subprocess_default_tp2():
    proc = subprocess.run([sys.executable, "-m", "tplayers", "verify", "--tp", "2"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for check in V.CHECKS:  # every registered check appears once, passing, at TP 2
        line = next(l for l in proc.stdout.splitlines() if l.startswith(check.name + " "))
        assert line.split()[-4:][0] == "2" and line.endswith("PASS"), line
    assert f"{len(V.CHECKS)}/{len(V.CHECKS)} checks passed" in proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_verify_under_torchrun_env():
    """The same code runs directly on ranks a launcher started (torchrun's env:// variables)."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = _env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "tplayers", "verify", "-k", "sequence_parallel", "--json"],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[1][0].strip() == ""  # only global rank 0 prints
    report = json.loads(outs[0][0])
    assert report["passed"] and {r["tp"] for r in report["results"]} == {2}
    assert len(report["results"]) == len(V.select_checks(["sequence_parallel"]))


@pytest.fixture
def broken_check(monkeypatch):
    """A check whose TP module deliberately differs from its dense reference (tests only)."""
    check = V.Check("BrokenColumn", "", _broken_column)
    V.CHECKS.append(check)  # the registry's list itself: select_checks and run_checks both read it
    yield check
    V.CHECKS.remove(check)


def _broken_column(g, cfg):
    dense = nn.Linear(8, 8).double()
    tp = ColumnParallelLinear.from_dense(dense, group=g)
    with torch.no_grad():
        tp.bias.add_(0.5)  # wrong by 0.5 in the output, right in the gradients
    return C._match(tp, dense, torch.randn(2, 8, dtype=torch.float64), g, cfg, output_shard_dim=-1)


def test_failing_check_is_reported_and_exits_nonzero(broken_check):
    results = V.run_checks(None, [broken_check.name, "Column->GELU->Row MLP"], V.VerifyConfig())
    bad, good = results
    assert not bad.passed and good.passed
    assert bad.forward_error == pytest.approx(0.5) and bad.grad_error < 1e-12  # measured despite failing
    assert "output differs from the dense reference" in bad.message
    table = V.format_table(results)
    assert "FAIL" in table.splitlines()[2] and "1/2 checks passed" in table
    assert "FAIL BrokenColumn (TP 1): AssertionError" in table
    assert V.exit_code(results) == 1 and V.exit_code([good]) == 0 and V.exit_code([]) == 1


def _broken_on_rank1(g, cfg):
    dense = nn.Linear(8, 8).double()
    tp = RowParallelLinear.from_dense(dense, group=g)
    if g.rank == 1:
        with torch.no_grad():
            tp.bias.add_(0.5)  # the replicated output is wrong on rank 1 only
    return C._match(tp, dense, torch.randn(2, 8, dtype=torch.float64), g, cfg, input_shard_dims=[-1])


def _run_with_check_failing_on_one_rank(group):
    check = V.Check("BrokenOnRank1", "", _broken_on_rank1)
    V.CHECKS.append(check)
    try:
        return V.run_checks(group, [check.name, "RowParallelLinear(input_is_parallel=True)"], V.VerifyConfig())
    finally:
        V.CHECKS.remove(check)


def test_check_failing_on_one_rank_only_is_a_fail_row_not_a_crash():
    # rank 1 fails the output comparison while rank 0 goes on into backward's collectives:
    # the mismatch must be raised only after them, or the ranks' collectives no longer pair up
    bad, good = V.merge_rank_results(get_world(2).run(_run_with_check_failing_on_one_rank))
    assert not bad.passed and "rank 1: output differs" in bad.message
    assert bad.forward_error == pytest.approx(0.5)
    assert good.passed


def test_merge_rank_results_any_rank_fails():
    ok = V.CheckResult("m", 2, 1e-16, 2e-16, True)
    bad = V.CheckResult("m", 2, math.nan, 3e-16, False, "rank 1: boom")
    (merged,) = V.merge_rank_results([[ok], [bad]])
    assert not merged.passed and merged.message == "rank 1: boom" and merged.grad_error == 3e-16
    assert "n/a" in V.format_table([merged])


def test_verify_json_is_strict_json_when_an_error_is_unmeasured():
    # a check that raised has NaN errors; Python's json would print the non-standard token NaN
    failed = V.CheckResult("m", 2, math.nan, math.nan, False, "ValueError: boom")
    text = json.dumps(V.report_json([failed, V.CheckResult("n", 2, 0.0, 1e-16, True)], "float64", "cpu"),
                      allow_nan=False)
    report = json.loads(text)
    assert report["results"][0]["forward_error"] is None and report["results"][1]["grad_error"] == 1e-16
    assert report["passed"] is False


def test_verify_low_precision_table_shows_each_checks_tolerance(capsys):
    checks = V.select_checks(["RowParallelLinear(input_is_parallel=True)", "ParallelGPT(loss, seq*"])
    assert [c.tol_scale for c in checks] == [1, 32]  # two different scales
    assert main(["verify", "--tp", "1", "--dtype", "bfloat16"] + [a for c in checks for a in ("-k", c.name)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tplayers verify: 2 checks, dtype=bfloat16")  # one TP size: no "x"
    assert lines[1].split()[-2:] == ["rtol/atol", "result"]
    for check, line in zip(checks, lines[3:5]):
        rtol, atol = V.tolerance(V.VerifyConfig(dtype="bfloat16", tol_scale=check.tol_scale))
        assert line.startswith(check.name) and line.split()[-2:] == [f"{rtol:g}/{atol:g}", "PASS"], line
    # float32/float64 use one unscaled tolerance (the header says which): no column
    assert "rtol/atol" not in V.format_table([V.CheckResult("m", 1, 0.0, 0.0, True, "", 1e-9, 1e-9)])


def test_verify_json_schema_2_only_adds_the_tolerances():
    v1_keys = {"name", "tp", "forward_error", "grad_error", "passed", "message"}
    cfg = V.VerifyConfig(dtype="float16", tol_scale=8)
    report = V.report_json([V.CheckResult("m", 2, 0.0, 1e-3, True, "", *V.tolerance(cfg))], "float16", "cpu")
    assert report["schema"] == V.SCHEMA == "tplayers-verify/2"
    assert set(report) == {"schema", "dtype", "device", "results", "passed"}
    (row,) = report["results"]
    assert set(row) == v1_keys | {"rtol", "atol"} and (row["rtol"], row["atol"]) == pytest.approx((4e-2, 8e-3))
    assert '"schema": "tplayers-verify/2"' in (ROOT / "docs" / "cli.md").read_text()


@pytest.mark.parametrize("read_first_line", [False, True])
def test_verify_json_into_a_closed_pipe_is_quiet(read_first_line):
    """`tplayers verify --json | head -1`: the reader leaving early is no error (no traceback, exit 0)."""
    proc = subprocess.Popen([sys.executable, "-m", "tplayers", "verify", "--tp", "1", "-k", "RowParallel", "--json"],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if read_first_line:  # like head -1: whether the rest is written before the close is a race
            assert proc.stdout.readline() == b"{\n"
        proc.stdout.close()  # without reading: every write gets EPIPE
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
    assert err == ""


def test_verify_usage_errors(capsys):
    assert main(["verify", "-k", "no-such-module"]) == 2
    assert main(["verify", "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == [c.name for c in V.CHECKS]
    with pytest.raises(SystemExit):
        main(["verify", "--tp", "0"])


# ---------------------------------------------------------------------------- bench


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
    assert {"overlap_saving_ms", "comm_bwd_ms", "hidden_fraction", "speedup_vs_dense", "speedup_vs_naive",
            "overlap_saving_ci_ms", "hidden_fraction_ci", "within_noise"} <= set(s)
    lo, hi = s["overlap_saving_ci_ms"]
    assert lo <= s["overlap_saving_ms"] <= hi and s["within_noise"] == (lo <= 0 <= hi)
    table = format_report(report)
    assert "TP fwd+bwd, overlap on" in table and "communication hidden by overlap" in table
    assert "95% interval" in table and (("WITHIN NOISE" in table) == s["within_noise"])
    if _has_matplotlib():
        plot_report(report, str(tmp_path / "b.png"))
        assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


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


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_bench_tp1_column_skips_naive(capsys):
    rc = main(["bench", "--tp", "1", "--module", "column", "--batch", "1", "--seq", "4", "--hidden", "8",
               "--iters", "2", "--warmup", "0", "--modes", "tp,dense,naive,comm_bwd,tp_blocking", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "skipped" in out and "needs --tp 2" in out
    assert "no collective at TP 1" in out


def test_bench_bad_shape_is_a_usage_error(capsys):
    assert main(["bench", "--tp", "2", "--ffn", "15", "--iters", "1"]) == 2
    assert "ffn=15 is not divisible by the TP degree 2" in capsys.readouterr().err
    assert main(["bench", "--modes", "tp,warp", "--iters", "1"]) == 2


def test_verify_tolerances_scale_only_in_low_precision():
    assert V.tolerance(V.VerifyConfig(dtype="float64", tol_scale=16)) == (1e-9, 1e-9)
    assert V.tolerance(V.VerifyConfig(dtype="bfloat16", tol_scale=4)) == pytest.approx((8e-2, 8e-2))
    assert V.tolerance(V.VerifyConfig(dtype="bfloat16", tol_scale=4, rtol=1e-3)) == pytest.approx((1e-3, 8e-2))



def test_bench_split_backward_mode_reports_its_own_accounting(capsys):
    for module in ("mlp", "block"):
        rc = main(["bench", "--tp", "2", "--module", module, "--batch", "1", "--seq", "8", "--hidden", "16", "--heads",
                   "2", "--iters", "1", "--warmup", "0", "--modes", "tp,tp_split,comm_bwd", "--json", "--no-progress"])
        report = json.loads(capsys.readouterr().out)
        assert rc == 0 and "tp_split" in report["timings"]
        split = report["split_backward"]
        assert split["collectives_per_step"] == report["summary"]["collectives_per_step"]  # the same collectives
        assert 0.0 <= split["exposed_comm_ms"] and split["backward_hidden_fraction_measured"] is not None
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
        chunked, plain = report["chunked"], report["summary"]["collectives_per_step"]
        assert chunked["chunks"] == 3
        assert chunked["collectives_per_step"]["all_reduce/forward"] == 3 * plain["all_reduce/forward"]
        assert chunked["forward_hidden_fraction"] is not None
        assert "batch chunks (mode tp_chunked, k=3)" in format_report(report)
        assert set(report["timeline"]) == {"tp", "tp_chunked"}
    with pytest.raises(SystemExit):
        main(["bench", "--chunks", "0"])


def test_bench_collective_matmul_mode_moves_the_forward_in_ring_steps(capsys):
    rc = main(["bench", "--tp", "2", "--module", "mlp", "--sequence-parallel", "--batch", "2", "--seq", "8", "--hidden",
               "16", "--iters", "1", "--warmup", "0", "--modes", "tp,tp_cm", "--json", "--no-progress"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and "tp_cm" in report["timings"]
    cm, plain = report["collective_matmul"]["collectives_per_step"], report["summary"]["collectives_per_step"]
    assert "all_gather/forward" in plain and "all_gather/forward" not in cm and cm["send/forward"] == 2  # p-1 each
    assert "collective matmul (mode tp_cm)" in format_report(report)


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

    from tplayers.bench.overlap import BenchConfig, BenchInputs
    from tplayers.core.accounting import comm_accounting
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


def test_bench_block_bad_heads_is_a_usage_error(capsys):
    assert main(["bench", "--tp", "2", "--module", "block", "--hidden", "16", "--heads", "3", "--iters", "1"]) == 2
    assert "hidden=16 is not divisible by heads=3" in capsys.readouterr().err
    assert main(["bench", "--tp", "4", "--module", "block", "--hidden", "16", "--heads", "2", "--iters", "1"]) == 2
    assert "heads=2 is not divisible by the TP degree 4" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "--save", "/no/such/dir/x.json"], "--save /no/such/dir/x.json: the directory /no/such/dir does not exist"),
    (["bench", "--plot", "/no/such/p.png"], "--plot /no/such/p.png: the directory /no/such does not exist"),
    (["bench", "--trace", "/no/such/dir/trace"], "--trace /no/such/dir/trace: cannot create it"),
    (["verify", "--backend", "nccl"], "--backend nccl needs --device cuda"),
    (["bench", "--warmup", "-1"], "warmup=-1 must be >= 0"),
])
def test_unusable_arguments_fail_before_anything_runs(capsys, monkeypatch, argv, message):
    import tplayers.cli.bench_cmd as bench_cmd
    import tplayers.cli.verify as verify

    def never(*args, **kwargs):
        raise AssertionError("ranks started before the arguments were checked")

    for command in (bench_cmd, verify):  # refused up front, not after a timed run
        monkeypatch.setattr(command, "run_on_ranks", never)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1  # one line


def test_bench_outputs_that_cannot_be_written_are_refused_first(capsys, tmp_path, monkeypatch):
    for flag in ("--save", "--plot"):  # an existing directory instead of a file name
        assert main(["bench", flag, str(tmp_path)]) == 2
        assert f"{flag} {tmp_path}: is a directory" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if tplayers[plot] were not installed
    assert main(["bench", "--plot", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err == "tplayers bench: --plot needs matplotlib: pip install 'tplayers[plot]'\n"


def test_bench_save_into_a_missing_directory_fails_before_the_run(monkeypatch, capsys):
    """Checked before any rank starts: the benchmark itself is never reached (a structural check,
    not a timed one: a wall-clock bound fails on a loaded machine)."""
    import tplayers.cli.bench_cmd as bench_cmd

    def never(args):
        raise AssertionError("the benchmark ran before its output path was checked")

    monkeypatch.setattr(bench_cmd, "bench_command", never)
    assert main(["bench", "--save", "/no/such/dir/x.json"]) == 2
    assert "the directory /no/such/dir does not exist" in capsys.readouterr().err


def test_bench_save_into_a_missing_directory_fails_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "tplayers", "bench", "--save", "/no/such/dir/x.json"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["tplayers bench: --save /no/such/dir/x.json: the directory /no/such/dir "
                                        "does not exist or is not writable"]


def test_bench_prints_its_result_before_a_write_that_fails(capsys, tmp_path, monkeypatch):
    import shutil

    import tplayers.cli.bench_cmd as bench_cmd

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run = bench_cmd.run_on_ranks

    def run_then_lose_the_directory(*args, **kwargs):
        result = run(*args, **kwargs)
        shutil.rmtree(out_dir)  # valid when checked, gone when written
        return result

    monkeypatch.setattr(bench_cmd, "run_on_ranks", run_then_lose_the_directory)
    rc = main(["bench", "--tp", "1", "--module", "column", "--batch", "1", "--seq", "4", "--hidden", "8", "--iters", "1",
               "--warmup", "0", "--modes", "tp,dense", "--no-progress", "--save", str(out_dir / "b.json")])
    captured = capsys.readouterr()
    assert rc == 1 and "TP fwd+bwd, overlap on" in captured.out  # the result is not lost
    assert captured.err.startswith("tplayers bench: could not write the result (printed above): ")
    assert captured.err.count("\n") == 1


def test_every_option_has_help_and_the_readme_names_the_default_shape():
    from tplayers.bench.overlap import SHAPES
    from tplayers.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "verify" in a.choices).choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"tplayers {name} {action.option_strings}: no help text"
    bench_default = subparsers["bench"].get_default("shape")
    readme = (ROOT / "docs" / "cli.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `--shape"))
    assert f"default {bench_default}" in row
    for name, dims in SHAPES.items():  # each named shape with its dimensions
        assert f"{name} [{dims['batch']}, {dims['seq']}, {dims['hidden']}] ffn {dims['ffn']}" in row, row


@pytest.mark.parametrize("argv", [["verify", "--timeout", "-1"], ["verify", "--timeout", "0"], ["verify", "--tp", "0"],
                                  ["bench", "--timeout", "nan"]])
def test_bad_numbers_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_refused(capsys):
    assert main(["verify", "--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_bench_trace_writes_one_trace_per_rank_without_profiler_noise(tmp_path):
    """The profiler's C++ side printed 'USDT: ... profiler_start' lines on stderr; they are kept out."""
    proc = subprocess.run([sys.executable, "-m", "tplayers", "bench", "--tp", "2", "--batch", "1", "--seq", "8",
                           "--hidden", "8", "--ffn", "16", "--iters", "2", "--warmup", "1", "--no-progress",
                           "--trace", str(tmp_path / "tr")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr
    assert sorted(p.name for p in (tmp_path / "tr").iterdir()) == ["bench_trace_rank0.json", "bench_trace_rank1.json"]
    assert "profiler trace (rank 0)" in proc.stdout


def test_docs_verify_sample_lists_every_check():
    """The sample output in docs/cli.md is what `tplayers verify` prints: every registered check, in order."""
    text = (ROOT / "docs" / "cli.md").read_text()
    sample = text[text.index("$ tplayers verify\n"): text.index("$ echo $?")]
    rows = [line.split("  ")[0] for line in sample.splitlines() if line.endswith("PASS")]
    assert rows == [c.name for c in V.CHECKS]
    assert f"tplayers verify: {len(V.CHECKS)} checks," in sample and f"{len(V.CHECKS)}/{len(V.CHECKS)} checks passed" in sample


def test_bench_emulated_link_json_keys(capsys):
    rc = main(["bench", "--tp", "2", "--batch", "1", "--seq", "8", "--hidden", "8", "--ffn", "16", "--iters", "3",
               "--warmup", "1", "--json", "--no-progress", "--link", "0.5/10"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["link"] == "0.5/10"  # the spec as given
    assert report["link"] == {"spec": "0.5/10", "bandwidth_gbps": 0.5, "latency_us": 10.0, "emulated": True}
    s = report["summary"]
    for key in ("hidden_fraction", "forward_hidden_fraction", "backward_hidden_fraction_measured", "exposed_comm_ms",
                "exposed_comm_fwd_ms", "exposed_comm_bwd_ms", "exposed_comm_estimate_ms"):
        assert isinstance(s[key], float), key
    assert abs(s["forward_hidden_fraction"]) < 0.05  # the forward all-reduce blocks: nothing hides it
    for mode in ("tp", "tp_blocking"):  # one step's intervals, for the timeline plot
        tl = report["timeline"][mode]
        assert [(c["op"], c["phase"]) for c in tl["collectives"]] == [("all_reduce", "forward"), ("all_reduce", "backward")]
        assert all(0 <= c["launch_ms"] <= c["wait_ms"] <= c["end_ms"] <= tl["step_ms"] for c in tl["collectives"])
    # Column -> GELU -> Row MLP without SP: one all-reduce forward (fc2), one backward (fc1), (1, 8, 8) float32
    assert s["collectives_per_step"] == {"all_reduce/backward": 1, "all_reduce/forward": 1}
    assert s["bytes_per_step"] == {"all_reduce/backward": 256, "all_reduce/forward": 256}
    # 256 bytes at 0.5 GB/s on 2 ranks: 0.5 us of bandwidth + 2 x 10 us of latency per all-reduce, all blocked on
    assert s["exposed_comm_fwd_ms"] >= 0.0205


def test_bench_bad_link_is_a_usage_error(capsys):
    assert main(["bench", "--link", "warp-drive"]) == 2
    assert "link 'warp-drive': expected a preset (h100-nvlink, pcie5, ib-ndr)" in capsys.readouterr().err


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
