"""What the always-on drift digest costs: a training step of a TP model whose forward carries the digests of
its inputs and replicated parameters in every checked collective (``carry_shared_state``, which
``parallelize`` registers), against the same step without them, and against collective checks off,
interleaved step by step on TP 2 CPU gloo ranks (real gloo).

Arms, in turn each step: ``digest`` (checks on, the model's forward carries its inputs' and replicated
parameters' digests), ``checks`` (checks on, nothing carried), ``off`` (``set_collective_checks(False)``).
Reported: the median over ``--repeats`` of each step's ratio to the step of the next arm (pairs cancel
the machine's drift), with quartiles, on the slower rank's time per step.

Modules: ``large`` = ``tplayers bench``'s transformer block at the ``large`` shape (batch 4, seq 256,
hidden 512, ffn 2048; 8 heads); ``small`` = its MLP (Column -> GELU -> Row) at the ``small`` shape
(batch 1, seq 16, hidden 64, ffn 256: latency-bound, decode-size all-reduces); ``decode`` = an MLP of
Llama-3-8B's widths (hidden 4096, ffn 14336) on one token (batch 1, seq 1): a decode step's all-reduce of
4096 elements.

``--device cuda``: both ranks share the first GPU (gloo on CUDA tensors); the digests are then taken on
the device and compared one collective late, and each step ends with a synchronization.

    PYTHONPATH=. python benchmarks/drift_digest_cost.py [--module large|small|decode] [--repeats 60]
        [--device cpu|cuda] [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn

import tplayers
from tplayers.bench.config import SHAPES
from tplayers.bench.report import quartiles
from tplayers.core.blocking import all_reduce_tensor
from tplayers.layers.shared_state import carry_shared_state
from tplayers.testing import World

ARMS = ("digest", "checks", "off")


def _hook_time(model: nn.Module, x: torch.Tensor, calls: int = 1000) -> float:
    """Microseconds per forward of the digests' work alone: the model's pre- and post-hook called directly
    (inputs and replicated parameters digested, generators read, pieces registered and cleared), plus the
    combination of the pieces into the carried bytes that the forward's first collective computes."""
    from tplayers.core.carried import carried

    pre, post = list(model._forward_pre_hooks.values())[-1], list(model._forward_hooks.values())[-1]
    pg = next(m for m in model.modules() if hasattr(m, "group")).group.process_group

    def one() -> None:
        pre(model, (x,), {})
        carried(pg, x.dtype, x.device)
        post(model, (x,), {}, None)

    for _ in range(20):
        one()
    _sync(x.device)
    t0 = time.perf_counter()
    for _ in range(calls):
        one()
    _sync(x.device)
    return 1e6 * (time.perf_counter() - t0) / calls


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


DECODE = {"batch": 1, "seq": 1, "hidden": 4096, "ffn": 14336}


def _rank(group, module: str, repeats: int, device: str = "cpu", dtype: str = "float32"):
    s = DECODE if module == "decode" else SHAPES["large" if module == "large" else "small"]
    if device == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    if module == "large":
        inner = tplayers.ParallelTransformerBlock(tplayers.BlockConfig(hidden=s["hidden"], n_heads=8,
                                                                       ffn_hidden=s["ffn"]), group=group)
    else:
        inner = tplayers.ParallelMLP(s["hidden"], s["ffn"], group=group)
    inner.to(device=device, dtype=getattr(torch, dtype))
    carried = nn.Sequential(inner)  # the same layers, once with the digests' hooks, once without
    carry_shared_state(carried, group=group)
    plain = nn.Sequential(inner)
    x = torch.randn(s["batch"], s["seq"], s["hidden"], generator=torch.Generator().manual_seed(1))
    x = x.to(device=device, dtype=getattr(torch, dtype)).requires_grad_()
    hooks = _hook_time(carried, x)
    times = {arm: [] for arm in ARMS}
    for i in range(len(ARMS) * (repeats + 2)):
        arm = ARMS[i % len(ARMS)]
        tplayers.set_collective_checks(arm != "off")
        model = carried if arm == "digest" else plain
        t0 = time.perf_counter()
        model(x).sum().backward()
        _sync(x.device)
        elapsed = time.perf_counter() - t0
        if i >= 2 * len(ARMS):  # two steps of each arm warm up
            times[arm].append(1e3 * elapsed)
    tplayers.set_collective_checks(True)
    slowest = {arm: all_reduce_tensor(torch.tensor(v), group=group, op="max") for arm, v in times.items()}
    medians = {arm: quartiles(v.tolist())[0] for arm, v in slowest.items()}
    return (medians, float(all_reduce_tensor(torch.tensor(hooks), group=group, op="max")), quartiles((slowest["digest"] / slowest["checks"]).tolist()),
            quartiles((slowest["checks"] / slowest["off"]).tolist()),
            quartiles((slowest["digest"] / slowest["off"]).tolist()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--module", default="large", choices=("large", "small", "decode"))
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    with World(2) as world:
        medians, hooks, digest, checks, total = world.run(_rank, args.module, args.repeats, args.device,
                                                          args.dtype)[0]
    where = "CPU gloo" if args.device == "cpu" else "gloo on CUDA tensors, both ranks on one GPU"
    print(f"TP 2, {where}, {args.module}, {args.dtype}: step medians " + ", ".join(f"{a} {m:.3f} ms" for a, m in medians.items()))
    print(f"  the digests' work alone: {hooks:.1f} us per forward (slower rank), "
          f"{100 * hooks / 1e3 / medians['checks']:.2f}% of the checked step")
    for what, (median, low, high) in (("digest / checks", digest), ("checks / off", checks), ("digest / off", total)):
        print(f"  {what}: paired median {median:.4f}x (quartiles {low:.4f}-{high:.4f}) over {args.repeats} steps")


if __name__ == "__main__":
    main()
