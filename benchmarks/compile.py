"""torch.compile vs eager for a tplayers MLP (Column -> GELU -> Row), same weights, same ranks, one run.

What it shows: the compiled step's time beside eager's (both with the overlap on), the first
compiled call's compile time, and that the compiled step gives eager's output and gradients. Under
compile tplayers' collectives are functional collectives (launched, then waited on where eager
waits), so the column backward's all-reduce still runs under the weight-gradient GEMM. Real gloo
on CPU ranks: the emulated link cannot be used (it is Python-side and sees nothing inside a graph).

    python benchmarks/compile.py --tp 2 --shapes small,large --iters 30 [--backends aot_eager,inductor]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tplayers import resolve_group  # noqa: E402
from tplayers.bench import SHAPES, fwd_bwd_step, time_steps  # noqa: E402
from tplayers.testing import World  # noqa: E402

from peers import _dense_mlp, build_tplayers  # noqa: E402  (the same MLP and TP build as peers.py)


def _output_and_grads(model: nn.Module, x: torch.Tensor, gy: torch.Tensor):
    xi = x.clone().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    out = model(xi)
    out.backward(gy)
    return [out.detach(), xi.grad] + [p.grad for p in model.parameters()]


def run(group: Any, shape: Dict[str, int], backends: List[str], iters: int, warmup: int) -> Dict[str, Any]:
    g = resolve_group(group)
    torch.manual_seed(0)
    b, s, h, ffn = shape["batch"], shape["seq"], shape["hidden"], shape["ffn"]
    dense = _dense_mlp(h, ffn)
    x, gy = torch.randn(b, s, h), torch.randn(b, s, h)  # (b, s, h)
    eager, _ = build_tplayers(dense, g)
    reference = _output_and_grads(eager, x, gy)
    steps = {"eager": fwd_bwd_step(eager, x.clone().requires_grad_(True), gy)}
    compile_s, errors = {}, {}
    for backend in backends:
        torch._dynamo.reset()
        model = torch.compile(build_tplayers(dense, g)[0], backend=backend, fullgraph=True)
        t0 = time.perf_counter()
        got = _output_and_grads(model, x, gy)  # the first call compiles forward and backward
        compile_s[backend] = time.perf_counter() - t0
        errors[backend] = max((a - r).abs().max().item() for a, r in zip(got, reference))
        steps[backend] = fwd_bwd_step(model, x.clone().requires_grad_(True), gy)
    timings = time_steps(steps, group=g, iters=iters, warmup=warmup)
    return {"shape": shape, "tp": g.size, "timings": {k: v.as_dict() for k, v in timings.items()},
            "first_call_s": compile_s, "max_abs_error_vs_eager": errors}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shapes", default="small,large", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--backends", default="aot_eager,inductor")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    print(f"torch {torch.__version__}  ranks={args.tp} (gloo, spawned)  threads/rank=1  REAL gloo, no emulation")
    with World(args.tp, threads=1, timeout=1800) as world:
        for name in args.shapes.split(","):
            res = world.run(run, dict(SHAPES[name]), backends, args.iters, args.warmup)[0]
            base = res["timings"]["eager"]["median_ms"]
            print(f"[{name}] {res['shape']}")
            for mode, t in res["timings"].items():
                extra = "" if mode == "eager" else (f"  first call {res['first_call_s'][mode]:.1f} s, "
                                                    f"max |diff| vs eager {res['max_abs_error_vs_eager'][mode]:.1e}")
                print(f"  {mode:<10} min {t['min_ms']:9.3f}  median {t['median_ms']:9.3f} ms  "
                      f"{t['median_ms'] / base:5.2f}x eager{extra}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
