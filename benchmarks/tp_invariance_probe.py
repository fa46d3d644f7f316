"""Which per-element results depend on the problem's shape on this build (issue 43, `tp_invariant`): the facts a
TP-invariant mode builds on. Bitwise comparisons, one process, no ranks.

    python benchmarks/tp_invariance_probe.py

- a column layer's output features computed alone (N = out/p) vs sliced from the whole GEMM;
- a token's output computed with fewer rows (M differs: micro-batches, sequence chunks);
- the row layer's contraction split into p partial GEMMs and summed, vs one GEMM (what TP does today);
- a fixed tree over L = 8 contraction leaves, computed as TP 1 and as TP 2 would (4 leaves each);
- a last-dim sum split in two and added; a softmax over fewer rows; GEMM and sum at 1 vs 2 threads.
"""
from __future__ import annotations

import torch

SHAPES = ((128, 256, 512), (512, 1024, 2048), (37, 304, 96), (32, 32, 32))  # (M, K, N)
LEAVES = 8


def _tree(values):
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


def _leaves(x, w, ranks):
    """The L leaves' partial products as ``ranks`` ranks compute them (each its L / ranks consecutive leaves)."""
    k = x.shape[1]
    per = LEAVES // ranks
    out = []
    for r in range(ranks):
        xs, ws = x[:, r * k // ranks:(r + 1) * k // ranks], w[:, r * k // ranks:(r + 1) * k // ranks]
        kr = xs.shape[1]
        out += [xs[:, i * kr // per:(i + 1) * kr // per] @ ws[:, i * kr // per:(i + 1) * kr // per].t()
                for i in range(per)]
    return out


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; True = bitwise equal")
    print(f"{'dtype':9} {'M, K, N':16} {'columns alone':>13} {'fewer rows':>10} {'K split p=2':>11} "
          f"{'K split p=4':>11} {'L=8 tree, TP1 vs TP2':>21}")
    for dtype in (torch.float32, torch.bfloat16):
        for m, k, n in SHAPES:
            x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
            full = x @ w.t()
            cols = all(torch.equal(full[:, i * n // p:(i + 1) * n // p], x @ w[i * n // p:(i + 1) * n // p].t())
                       for p in (2, 4) for i in range(p))
            rows = torch.equal(full[:m // 2], x[:m // 2] @ w.t())
            split = [torch.equal(full, sum(x[:, i * k // p:(i + 1) * k // p] @ w[:, i * k // p:(i + 1) * k // p].t()
                                           for i in range(p))) for p in (2, 4)]
            tree = torch.equal(_tree(_leaves(x, w, 1)), _tree(_leaves(x, w, 2)))
            print(f"{str(dtype)[6:]:9} {f'{m}, {k}, {n}':16} {cols!s:>13} {rows!s:>10} {split[0]!s:>11} "
                  f"{split[1]!s:>11} {tree!s:>21}")
    v = torch.randn(64, 4096)
    print("last-dim sum vs its two halves summed:", torch.equal(v.sum(-1), v[:, :2048].sum(-1) + v[:, 2048:].sum(-1)))
    print("softmax over fewer rows:", torch.equal(torch.softmax(v, -1)[:32], torch.softmax(v[:32], -1)))
    threads = torch.get_num_threads()
    for dtype in (torch.float32, torch.bfloat16):
        x, w, s = torch.randn(512, 1024).to(dtype), torch.randn(2048, 1024).to(dtype), torch.randn(64, 4096).to(dtype)
        torch.set_num_threads(max(2, threads))
        a, sa = x @ w.t(), s.sum(-1)
        torch.set_num_threads(1)
        b, sb = x @ w.t(), s.sum(-1)
        torch.set_num_threads(threads)
        print(f"{str(dtype)[6:]}: GEMM at 1 vs {max(2, threads)} threads {torch.equal(a, b)}, "
              f"last-dim sum {torch.equal(sa, sb)}")


if __name__ == "__main__":
    main()
