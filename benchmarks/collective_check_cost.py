"""What the collective fingerprints cost: a training step with ``set_collective_checks`` on against
the same step with it off, interleaved step by step, on TP 2 CPU gloo ranks (real gloo).

The module is ``tplayers bench``'s transformer block (``ParallelTransformerBlock``) at a named shape
(``large``: batch 4, seq 256, hidden 512, ffn 2048; 8 heads), forward + backward; each collective it
issues is preceded, with checks on, by one all-gather of ten int64. Medians over ``--repeats`` steps
per arm, and the median (with quartiles) of the ratio of each checked step to the unchecked step
that follows it (pairs cancel the machine's drift), on the slower rank's time per step.

    PYTHONPATH=. python benchmarks/collective_check_cost.py [--shape large] [--repeats 40] [--layers 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

import tplayers
from tplayers.bench.config import SHAPES
from tplayers.bench.report import quartiles
from tplayers.core.blocking import all_reduce_tensor
from tplayers.testing import World


def _rank(group, shape: str, layers: int, repeats: int):
    s = SHAPES[shape]
    torch.manual_seed(0)
    config = tplayers.BlockConfig(hidden=s["hidden"], n_heads=8, ffn_hidden=s["ffn"])
    model = nn.Sequential(*[tplayers.ParallelTransformerBlock(config, group=group) for _ in range(layers)])
    x = torch.randn(s["batch"], s["seq"], s["hidden"], generator=torch.Generator().manual_seed(1), requires_grad=True)
    times = {True: [], False: []}
    counted = []
    for i in range(2 * repeats + 4):
        checks = i % 2 == 0
        tplayers.set_collective_checks(checks)
        with tplayers.comm_accounting() as acc:
            t0 = time.perf_counter()
            model(x).sum().backward()
            elapsed = time.perf_counter() - t0
        if i >= 4:  # the first two steps of each arm warm up
            times[checks].append(1e3 * elapsed)
            counted.append(len(acc.records))
    tplayers.set_collective_checks(True)
    slowest = lambda v: all_reduce_tensor(torch.tensor(v), group=group, op="max")  # noqa: E731
    on, off = slowest(times[True]), slowest(times[False])  # per step, the slower rank's time
    # each checked step against the unchecked step right after it
    return statistics.median(on.tolist()), statistics.median(off.tolist()), *quartiles((on / off).tolist()), max(counted)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="large", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    with World(2) as world:
        on, off, ratio, low, high, collectives = world.run(_rank, args.shape, args.layers, args.repeats)[0]
    print(f"TP 2, CPU gloo, shape {args.shape}, {args.layers} block(s), {collectives} collectives per step: step with "
          f"checks {on:.2f} ms, without {off:.2f} ms (medians); paired ratio {ratio:.4f}x (quartiles {low:.4f}-"
          f"{high:.4f}) over {args.repeats} pairs of interleaved steps, the slower rank's time per step")


if __name__ == "__main__":
    main()
