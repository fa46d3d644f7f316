"""Is the emulated link faithful? Each collective alone, timed under `tplayers.emulated_link`,
against its modeled alpha-beta time: the median of measured / modeled over many runs.

    python benchmarks/link_fidelity.py --link 0.5/20 --ranks 2 4 --iters 50
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import tplayers
from tplayers.core.collectives import all_gather, all_reduce, reduce_scatter
from tplayers.testing import World

SIZES = [4 << 10, 256 << 10, 4 << 20]  # bytes of the full buffer


def _ratios(group, spec: str, iters: int):
    g = tplayers.resolve_group(group)
    link = tplayers.parse_link(spec)
    out = {}
    for nbytes in SIZES:
        n = nbytes // 4
        ops = {"all_reduce": lambda: all_reduce(torch.ones(n), g).wait(),
               "all_gather": lambda: all_gather(torch.ones(n // g.size), 0, g).wait(),
               "reduce_scatter": lambda: reduce_scatter(torch.ones(n), 0, g).wait()}
        for op, call in ops.items():
            modeled = link.seconds(op, nbytes, g.size)
            times = []
            with tplayers.emulated_link(link):
                for _ in range(iters):
                    tplayers.core.blocking.barrier(g)  # (emulated too; not timed)
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
            out[(op, nbytes)] = (statistics.median(times) / modeled, modeled)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--link", default="0.5/20")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    print(f"link {args.link}: median measured / modeled time of each collective alone (slowest rank)")
    for p in args.ranks:
        with World(p) as world:
            per_rank = world.run(_ratios, args.link, args.iters)
        for key in per_rank[0]:
            ratio = max(r[key][0] for r in per_rank)
            op, nbytes = key
            print(f"  p={p} {op:<15} {nbytes / 1024:>8.0f} KiB  modeled {1e3 * per_rank[0][key][1]:8.3f} ms  "
                  f"ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
