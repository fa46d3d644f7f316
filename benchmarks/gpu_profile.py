"""Where a simulated TP rank's GPU time goes, per bench mode: GEMMs, attention, copies, other kernels, the emulated
link, and the GPU idle while the host catches up. One rank of TP ``--tp`` on the fake process group (as
``tplayers bench --simulate``), the link emulated on the GPU's timeline; ``--iters`` steps of each mode under
torch.profiler after ``--warmup``; kernel time summed by category over the compute stream, and idle = the step's
wall time on the GPU minus the union of the compute stream's kernels (the link's sleep runs on its own stream).

    python benchmarks/gpu_profile.py --shape llama3-8b --tp 8 --batch 4 --seq 2048 [--sequence-parallel] --json out.json

Needs a GPU (it profiles CUDA kernels); on the CPU it runs the same steps and reports the CPU ops' categories only
(a smoke test of the script, no figures).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tplayers.bench.accounting import emulated_link  # noqa: E402
from tplayers.bench.config import LAYER_SHAPES, BenchConfig  # noqa: E402
from tplayers.bench.counts import count_step  # noqa: E402
from tplayers.bench.measure import resolve_link  # noqa: E402
from tplayers.bench.overlap import MODE_TABLE, BenchInputs  # noqa: E402
from tplayers.bench.simulate import simulated_rank  # noqa: E402
from tplayers.core.groups import resolve_group  # noqa: E402

CATEGORIES = (  # (category, substrings of a kernel's name), first match wins
    ("link (emulated)", ("sleep", "spin")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "sm80_xmma", "cublas", "matmul", "splitk")),
    ("copies", ("copy", "cat", "memcpy", "memset", "fill", "transpose", "permute", "index")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "elementwise / other"


def _union(intervals: List[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def breakdown(prof: Any, steps: int) -> Dict[str, float]:
    """ms per step by category (device kernels), the steps' GPU span and idle (CUDA only)."""
    by_cat: Dict[str, float] = defaultdict(float)
    streams: Dict[Any, List[Tuple[float, float]]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.time_range.elapsed_us()
            by_cat[category(e.name)] += us
            if category(e.name) != "link (emulated)":
                streams[getattr(e, "device_resource_id", 0)].append((e.time_range.start, e.time_range.end))
    out = {cat: us / 1e3 / steps for cat, us in sorted(by_cat.items())}
    if streams:
        compute = max(streams.values(), key=lambda iv: sum(b - a for a, b in iv))  # the busiest stream
        span = max(b for _, b in compute) - min(a for a, _ in compute)
        out["gpu span"] = span / 1e3 / steps
        out["compute stream idle"] = (span - _union(compute)) / 1e3 / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(LAYER_SHAPES), default="llama3-8b")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--modes", default="tp,tp_blocking,tp_split,tp_chunked,tp_cm,compute")
    ap.add_argument("--link", default="h100-nvlink")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = dict(LAYER_SHAPES[args.shape], batch=args.batch, seq=args.seq)
    cfg = BenchConfig(module="block", **shape, dtype=args.dtype, device=device, sequence_parallel=args.sequence_parallel,
                      chunks=args.chunks, link=args.link)
    with simulated_rank(args.tp) as group:
        g = resolve_group(group)
        inputs = BenchInputs.create(g, cfg)
        link = resolve_link(args.link, g)
        name_of_device = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        report: Dict[str, Any] = {"config": vars(args), "device": name_of_device, "torch": torch.__version__,
                                  "modes": {}}
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        for name in args.modes.split(","):
            why = MODE_TABLE[name].skip(inputs)
            if why is not None:
                report["modes"][name] = {"skipped": why}
                continue
            step = MODE_TABLE[name].build(inputs)
            with emulated_link(link):
                for _ in range(args.warmup):
                    step()
                counts = count_step(step)
                if device == "cuda":
                    torch.cuda.synchronize()
                with profile(activities=activities) as prof:
                    for _ in range(args.iters):
                        step()
                    if device == "cuda":
                        torch.cuda.synchronize()
            entry = {"counts": {k: counts[k] for k in ("kernels", "moved_bytes", "gemm_flops", "host_syncs")}}
            try:  # (the profiler's event fields move between torch versions: a failure here loses the split only)
                entry["ms_per_step"] = breakdown(prof, args.iters) if device == "cuda" else {}
            except Exception as e:  # noqa: BLE001
                entry["ms_per_step"], entry["breakdown_error"] = {}, f"{type(e).__name__}: {e}"
                print(f"{name}: no breakdown ({entry['breakdown_error']})", flush=True)
            report["modes"][name] = entry
            parts = ", ".join(f"{k} {v:.3f}" for k, v in entry["ms_per_step"].items())
            print(f"{name:12s} kernels {counts['kernels']:4d}  moved {counts['moved_bytes'] / 1e6:9.1f} MB  {parts}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
