"""tp_invariant's cross-rank step, two ways: an all-gather of every rank's subtree sum and the tree's top on every
rank (p - 1 times the tensor received per rank), or an all-to-all of the subtree sums' chunks, the tree over the p
received and an all-gather of the summed chunks (a ring all-reduce's bytes, two collectives). Both give the same
bits (each element's tree over the p ranks); this measures which is faster here, alternating call by call in one
run (paired ratio of the slower rank's time), for a (tokens, hidden) float32 subtree sum.

    PYTHONPATH=. python benchmarks/tp_invariant_cross_rank.py [--tp 2] [--tokens 1024] [--hidden 256] [--repeats 20]
        [--link match:h100-nvlink]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import tplayers
from tplayers.bench.measure import resolve_link
from tplayers.bench.report import quartiles
from tplayers.core.blocking import all_reduce_tensor
from tplayers.core.groups import resolve_group
from tplayers.bench.budget import wire_bytes
from tplayers.core.invariant import _across  # noqa: PLC2701 (the step measured, both ways)
from tplayers.testing import World


def _rank(group, tokens: int, hidden: int, repeats: int, link: str):
    g = resolve_group(group)
    local = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(g.rank))
    ways = {how: (lambda t, g, how=how: _across(t, g, how=how)) for how in ("all_gather", "all_to_all")}
    results = {name: fn(local, g) for name, fn in ways.items()}
    same = torch.equal(results["all_gather"], results["all_to_all"])
    times = {name: [] for name in ways}
    nbytes = {}
    with tplayers.emulated_link(resolve_link(link, g)) if link else contextlib.nullcontext():
        for i in range(2 * repeats + 2):
            name = list(ways)[i % 2]
            with tplayers.comm_accounting() as acc:
                t0 = time.perf_counter()
                ways[name](local, g)
                elapsed = time.perf_counter() - t0
            nbytes[name] = sum(wire_bytes(r.op, r.nbytes, g.size) for r in acc.records)
            if i >= 2:
                times[name].append(1e3 * elapsed)
    slowest = {name: all_reduce_tensor(torch.tensor(v), group=group, op="max").tolist() for name, v in times.items()}
    return slowest, nbytes, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--link", default=None, help="an emulated link (e.g. match:h100-nvlink); default: real gloo")
    args = parser.parse_args()
    with World(args.tp) as world:
        times, nbytes, same = world.run(_rank, args.tokens, args.hidden, args.repeats, args.link)[0]
    ratios = [b / a for a, b in zip(times["all_gather"], times["all_to_all"])]
    q = quartiles(ratios)
    print(f"{'EMULATION (' + args.link + ')' if args.link else 'real gloo'}, TP {args.tp}, ({args.tokens}, "
          f"{args.hidden}) float32: all_gather {statistics.median(times['all_gather']):.3f} ms, all_to_all + "
          f"all_gather {statistics.median(times['all_to_all']):.3f} ms (medians); paired ratio "
          f"{statistics.median(ratios):.3f}x "
          f"(quartiles {q[1]:.3f}-{q[2]:.3f}) over {len(ratios)} pairs; wire bytes "
          f"{nbytes['all_gather'] / 1e6:.3f} vs {nbytes['all_to_all'] / 1e6:.3f} MB; the same bits: {same}")


if __name__ == "__main__":
    main()
