"""`tplayers bench --simulate --predict GPU`: each mode's step PREDICTED from one step recorded on the meta device
(tplayers.bench.predict): the replay's clocks on known events, and the command end to end."""
import json

import pytest

from tplayers.bench.link import LinkModel
from tplayers.bench.predict import GPUModel, replay
from tplayers.cli import main

GPU = GPUModel("test", gemm_tflops=1.0, attention_tflops=1.0, memory_gbps=1.0, kernel_us=0.0, host_us=0.0,
               collective_host_us=0.0)
LINK = LinkModel(1.0, 0.0)  # 1 GB/s: a 1e6-byte broadcast takes 1 ms


def test_replay_overlaps_a_collective_with_the_kernels_issued_before_its_wait():
    gemm = ("kernel", "mm", 1e9, 0, "gemm")  # 1 GFLOP at 1 TFLOP/s: 1 ms
    copy = ("kernel", "copy_", 0, 5e5, None)  # 0.5 MB at 1 GB/s: 0.5 ms
    hidden = [("launch", 0, "broadcast", 10**6, 2), gemm, ("wait", 0), copy]
    r = replay(hidden, GPU, LINK)
    assert r["step_ms"] == pytest.approx(1.5) and r["stream_waits_ms"] == pytest.approx(0.0)
    exposed = [("launch", 0, "broadcast", 2 * 10**6, 2), gemm, ("wait", 0), copy]  # 2 ms on the link
    r = replay(exposed, GPU, LINK)
    assert r["step_ms"] == pytest.approx(2.5) and r["stream_waits_ms"] == pytest.approx(1.0)
    assert r["gemm_ms"] == pytest.approx(1.0) and r["memory_ms"] == pytest.approx(0.5) and r["link_ms"] == 2.0


def test_replay_charges_the_host_and_its_syncs():
    slow_host = GPUModel("host", 1.0, 1.0, 1.0, kernel_us=0.0, host_us=1000.0, collective_host_us=0.0)
    tiny = ("kernel", "add", 0, 0, None)
    r = replay([tiny] * 4, slow_host, LINK)  # each kernel waits for the host to issue it: 4 ms
    assert r["step_ms"] == pytest.approx(4.0) and r["host_bound_ms"] == pytest.approx(4.0)
    gemm = ("kernel", "mm", 3e9, 0, "gemm")  # 3 ms on the GPU
    r = replay([gemm, ("sync",), tiny], slow_host, LINK)  # the sync waits for the GEMM before issuing the next
    assert r["step_ms"] == pytest.approx(1.0 + 3.0 + 1.0)


def test_predict_command_labels_a_prediction_and_ranks_the_modes(capsys):
    argv = ["bench", "--simulate", "--predict", "h200", "--tp", "8", "--module", "block", "--batch", "2", "--seq",
            "64", "--hidden", "256", "--ffn", "512", "--heads", "8", "--dtype", "bfloat16", "--link", "h100-nvlink",
            "--sequence-parallel", "--modes", "tp,tp_blocking,tp_cm,comm,compute"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert table.startswith("PREDICTION, not a measurement: one rank of TP 8 on an H200")
    assert main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "tplayers-bench-predict/1" and "not measured" in report["prediction"]["gpu"]["note"]
    modes = report["prediction"]["modes"]
    assert set(modes) == {"tp", "tp_blocking", "tp_cm", "comm", "compute"}
    limit = max(modes["compute"]["step_ms"], modes["comm"]["step_ms"])
    assert report["prediction"]["limit_ms"] == limit
    for name in ("tp", "tp_blocking", "tp_cm"):  # no schedule beats the limit; overlap never loses to blocking
        assert modes[name]["step_ms"] >= limit and modes[name]["vs_limit"] >= 1
    assert modes["tp"]["step_ms"] <= modes["tp_blocking"]["step_ms"]
    assert report["counts"]["tp"]["gemm_flops"] == report["counts"]["compute"]["gemm_flops"] > 0
    assert main(["bench", "--predict", "h200"]) == 2  # a prediction records one rank: --simulate
