"""tplayers vs its peers on the same MLP (Column -> GELU -> Row), same weights, same ranks, one run.

Peers: dense single-process torch.nn, tplayers, PyTorch DTensor TP (parallelize_module with
ColwiseParallel / RowwiseParallel), megatron-core and fairscale Column/RowParallelLinear.
Every peer's output, input gradient and local weight-gradient shards are checked against the
dense model before it is timed; a peer that cannot be imported, built or run here is skipped
with the reason. Timing: tplayers.bench.time_steps (barrier, slowest rank per iteration,
modes interleaved), forward+backward, fp32.

    pip install -r benchmarks/requirements.txt        # megatron-core, fairscale (torch pinned)
    python benchmarks/peers.py --tp 2 --shapes small,large,comm-heavy --iters 30 [--json out.json]
    python benchmarks/peers.py --link match:h100-nvlink ...   # every peer over the same EMULATED link

``--link``: `tplayers.emulated_link(spec, everywhere=True)` around the timing, so tplayers'
collectives and the ones DTensor (functional collectives), megatron-core and fairscale call through
torch.distributed all complete no earlier than the same alpha-beta times (a functional collective
blocks until then: DTensor waits on first use anyway).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tplayers import ColumnParallelLinear, RowParallelLinear, emulated_link, parse_link, resolve_group  # noqa: E402
from tplayers.core.blocking import all_reduce_tensor
from tplayers.bench.link import matmul_tflops  # noqa: E402
from tplayers.bench import SHAPES, fwd_bwd_step, time_steps  # noqa: E402
from tplayers.testing import World  # noqa: E402

PEERS = ("dense", "tplayers", "dtensor", "megatron-core", "fairscale")
RTOL, ATOL = 1e-4, 1e-5


def _dense_mlp(h: int, ffn: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(h, ffn), nn.GELU(), nn.Linear(ffn, h))


class _TupleMLP(nn.Module):
    """fc1 -> GELU -> fc2 for peers whose linears return (output, bias)."""

    def __init__(self, fc1: nn.Module, fc2: nn.Module) -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = h[0] if isinstance(h, tuple) else h
        y = self.fc2(F.gelu(h))
        return y[0] if isinstance(y, tuple) else y


def _copy_shards(fc1: nn.Module, fc2: nn.Module, dense: nn.Sequential, g: Any) -> None:
    with torch.no_grad():
        fc1.weight.copy_(g.shard(dense[0].weight, 0))
        fc1.bias.copy_(g.shard(dense[0].bias, 0))
        fc2.weight.copy_(g.shard(dense[2].weight, 1))
        fc2.bias.copy_(dense[2].bias)


# ------------------------------------------------------------------ peers: build a TP MLP from dense


def build_tplayers(dense: nn.Sequential, g: Any) -> Tuple[nn.Module, Callable]:
    model = nn.Sequential(ColumnParallelLinear.from_dense(dense[0], group=g), nn.GELU(),
                          RowParallelLinear.from_dense(dense[2], group=g))
    return model, lambda: (model[0].weight.grad, model[2].weight.grad)


def build_dtensor(dense: nn.Sequential, g: Any) -> Tuple[nn.Module, Callable]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (g.size,))
    model = parallelize_module(copy.deepcopy(dense), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, lambda: (model[0].weight.grad.to_local(), model[2].weight.grad.to_local())


def build_megatron(dense: nn.Sequential, g: Any) -> Tuple[nn.Module, Callable]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import ModelParallelConfig, parallel_state
        from megatron.core.tensor_parallel import ColumnParallelLinear as MCol
        from megatron.core.tensor_parallel import RowParallelLinear as MRow

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=g.size)
    config = ModelParallelConfig(tensor_model_parallel_size=g.size, use_cpu_initialization=True,
                                 perform_initialization=False, params_dtype=torch.float32,
                                 gradient_accumulation_fusion=False)
    init = nn.init.zeros_
    h, ffn = dense[0].in_features, dense[0].out_features
    fc1 = MCol(h, ffn, config=config, init_method=init, bias=True, gather_output=False)
    fc2 = MRow(ffn, h, config=config, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False)
    _copy_shards(fc1, fc2, dense, g)
    model = _TupleMLP(fc1, fc2)
    return model, lambda: (fc1.weight.grad, fc2.weight.grad)


def build_fairscale(dense: nn.Sequential, g: Any) -> Tuple[nn.Module, Callable]:
    from fairscale.nn.model_parallel import initialize as fs_init
    from fairscale.nn.model_parallel.layers import ColumnParallelLinear as FCol
    from fairscale.nn.model_parallel.layers import RowParallelLinear as FRow

    if not fs_init.model_parallel_is_initialized():
        fs_init.initialize_model_parallel(g.size)
    h, ffn = dense[0].in_features, dense[0].out_features
    fc1 = FCol(h, ffn, bias=True, gather_output=False, init_method=nn.init.zeros_)
    fc2 = FRow(ffn, h, bias=True, input_is_parallel=True, init_method=nn.init.zeros_)
    _copy_shards(fc1, fc2, dense, g)
    model = _TupleMLP(fc1, fc2)
    return model, lambda: (fc1.weight.grad, fc2.weight.grad)


BUILDERS: Dict[str, Callable] = {
    "tplayers": build_tplayers,
    "dtensor": build_dtensor,
    "megatron-core": build_megatron,
    "fairscale": build_fairscale,
}


# ------------------------------------------------------------------ check, then time


def _check_against_dense(model: nn.Module, grads: Callable, dense: nn.Sequential, x: torch.Tensor,
                         gy: torch.Tensor, g: Any) -> float:
    """Output, input grad and local weight-grad shards vs dense; returns the max abs error."""
    xd, xt = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    dense.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    yd, yt = dense(xd), model(xt)
    yd.backward(gy)
    yt.backward(gy)
    w1, w2 = grads()
    pairs = [("output", yt, yd), ("input grad", xt.grad, xd.grad),
             ("fc1 weight grad", w1, g.shard(dense[0].weight.grad, 0)),
             ("fc2 weight grad", w2, g.shard(dense[2].weight.grad, 1))]
    worst = 0.0
    for what, a, e in pairs:
        if a is None or a.shape != e.shape or not torch.allclose(a, e, rtol=RTOL, atol=ATOL):
            err = float((a.detach() - e).abs().max()) if a is not None and a.shape == e.shape else float("nan")
            raise AssertionError(f"{what} differs from dense (max abs error {err:.3e})")
        worst = max(worst, float((a.detach() - e).abs().max()))
    return worst


def run_peers(group: Any, shape: Dict[str, int], peers: List[str], iters: int, warmup: int,
              seed: int, link: Optional[str] = None) -> Dict[str, Any]:
    g = resolve_group(group)
    torch.manual_seed(seed)
    b, s, h, ffn = shape["batch"], shape["seq"], shape["hidden"], shape["ffn"]
    dense = _dense_mlp(h, ffn)
    x = torch.randn(b, s, h)  # (b, s, h)
    gy = torch.randn(b, s, h)
    steps: Dict[str, Callable[[], None]] = {}
    skipped: Dict[str, str] = {}
    errors: Dict[str, float] = {}

    def fwd_bwd(model: nn.Module) -> Callable[[], None]:
        return fwd_bwd_step(model, x.clone().requires_grad_(True), gy)

    for peer in peers:
        if peer == "dense":
            steps[peer] = fwd_bwd(dense)
            continue
        try:
            model, grads = BUILDERS[peer](dense, g)
            errors[peer] = _check_against_dense(model, grads, dense, x, gy, g)
        except Exception as e:  # not installed, not runnable on CPU, or wrong: skip with the reason
            last = traceback.format_exc().strip().splitlines()[-1]
            skipped[peer] = f"{type(e).__name__}: {e}".splitlines()[0][:300] or last
            continue
        steps[peer] = fwd_bwd(model)
    # every rank must time the same steps: drop peers that failed on any rank
    from tplayers.core.blocking import all_gather_tensor

    ok = torch.tensor([[0.0 if p in steps else 1.0 for p in peers]])
    failed_any = all_gather_tensor(ok, 0, group=g).amax(0) if g.size > 1 else ok[0]
    for p, bad in zip(peers, failed_any.tolist()):
        if bad and p in steps:
            del steps[p]
            skipped.setdefault(p, "failed on another rank")
    model = None
    if link is not None:  # one link model for every rank: match: uses the slowest rank's throughput
        tflops = None
        if link.startswith("match:"):
            tflops = -float(all_reduce_tensor(torch.tensor([-matmul_tflops()], dtype=torch.float64), group=g, op="max"))
        model = parse_link(link, tflops=tflops)
    with emulated_link(model, everywhere=True) if model is not None else contextlib.nullcontext():
        timings = time_steps(steps, group=g, iters=iters, warmup=warmup)
    return {"shape": shape, "tp": g.size, "timings": {k: v.as_dict() for k, v in timings.items()},
            "max_abs_error_vs_dense": errors, "skipped": skipped,
            "link": None if model is None else {"spec": link, "bandwidth_gbps": model.bandwidth_gbps,
                                                "latency_us": model.latency_us, "emulated": True}}


def _versions() -> Dict[str, str]:
    out = {"torch": torch.__version__}
    for name, mod in (("megatron-core", "megatron.core"), ("fairscale", "fairscale")):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = __import__(mod, fromlist=["__version__"])
            out[name] = getattr(m, "__version__", "?")
        except Exception as e:
            out[name] = f"not importable ({type(e).__name__})"
    return out


def format_rows(result: Dict[str, Any]) -> str:
    t = result["timings"]
    base = t.get("tplayers", {}).get("median_ms")
    sh = result["shape"]
    link = result.get("link")
    wire = "" if not link else f"  EMULATED link {link['spec']} ({link['bandwidth_gbps']:.4g} GB/s, {link['latency_us']:g} us)"
    lines = [f"shape b={sh['batch']} s={sh['seq']} h={sh['hidden']} ffn={sh['ffn']}  tp={result['tp']}{wire}",
             f"  {'peer':<14} {'min ms':>9} {'median ms':>9} {'vs tplayers':>11} {'max err':>9}"]
    for peer, timing in t.items():
        rel = f"{timing['median_ms'] / base:10.2f}x" if base else "         -"
        err = result["max_abs_error_vs_dense"].get(peer)
        lines.append(f"  {peer:<14} {timing['min_ms']:9.3f} {timing['median_ms']:9.3f} {rel} "
                     f"{'' if err is None else f'{err:9.1e}'}")
    for peer, why in result["skipped"].items():
        lines.append(f"  {peer:<14} skipped: {why}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shapes", default="small,large,comm-heavy", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write all results as JSON")
    ap.add_argument("--link", metavar="SPEC", default=None,
                    help="time every peer over the same emulated link (tplayers.emulated_link(..., everywhere=True))")
    args = ap.parse_args(argv)
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(PEERS)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}; choose from {PEERS}")
    results = []
    print(f"versions: {_versions()}  threads/rank=1  ranks={args.tp} (gloo, spawned)")
    with World(args.tp, threads=1, timeout=1800) as world:
        for name in args.shapes.split(","):
            shape = dict(SHAPES[name])
            res = world.run(run_peers, shape, peers, args.iters, args.warmup, args.seed, args.link)[0]
            res["name"] = name
            results.append(res)
            print(f"[{name}] " + format_rows(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": _versions(), "tp": args.tp, "iters": args.iters, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
