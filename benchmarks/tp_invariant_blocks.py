"""The cost of tp_invariant's per-block GEMM calls (`tplayers.core.invariant._per_block`: one ``mm`` per block, the
same kernel at every TP degree) beside one batched ``bmm`` of the same blocks (what the mode ran before: its batch
count, 8/p, chose the kernel). One process, 1 thread; the two alternate call by call (paired medians), float32 and
bfloat16, a decoding step's few tokens and a training step's many, the blocks of one rank at TP 1, 2 and 4.

    PYTHONPATH=. python benchmarks/tp_invariant_blocks.py [--hidden 4096] [--repeats 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tplayers.core.invariant import LEAVES, _per_block


def _time(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    h = args.hidden
    print(f"row layer's leaf products (tokens, h/8) x (h/8, h) per block, hidden {h}; per call: median of 5 rounds, "
          f"{args.repeats} calls each, alternating")
    print(f"{'dtype':9} {'tokens':>6} {'TP':>3} {'blocks':>6} {'bmm us':>9} {'per-block us':>13} {'ratio':>6} "
          f"{'same bits':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in (1, 8, 512):
            repeats = max(5, args.repeats // (64 if tokens > 8 else 1))
            for tp in (1, 2, 4):
                blocks = LEAVES // tp
                a = torch.randn(blocks, tokens, h // LEAVES).to(dtype)
                b = torch.randn(blocks, h // LEAVES, h).to(dtype)
                pairs = [(_time(lambda: torch.bmm(a, b), repeats), _time(lambda: _per_block(a, b), repeats))
                         for _ in range(5)]
                batched, per = (statistics.median(p[i] for p in pairs) * 1e6 for i in (0, 1))
                same = torch.equal(torch.bmm(a, b), _per_block(a, b))
                print(f"{str(dtype).replace('torch.', ''):9} {tokens:6} {tp:3} {blocks:6} {batched:9.1f} {per:13.1f} "
                      f"{per / batched:6.2f} {str(same):>9}")


if __name__ == "__main__":
    main()
