"""How far a bfloat16 TP gradient and its dense reference each are from the exact value: `tplayers verify`'s tied
embedding + head check (``head(tanh(embed(ids)))``, one weight, vocabulary 8p+3), both in bfloat16 from the same
weights and inputs, against a float64 copy of the dense module. Per seed: each one's largest absolute error against the
float64 truth, the gradient's largest magnitude, and the elements outside the elementwise tolerance verify used
before (rtol = atol = 0.04) with their dense, TP and exact values. Why `assert_matches_dense` judges a low-precision
tensor outside that tolerance against the float64 truth (docs/layers.md).

    python benchmarks/bf16_truth.py [--tp 4] [--seeds 0,1,2,3]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _rank(group, seed: int):
    import tplayers
    from tplayers import ParallelLMHead, VocabParallelEmbedding
    from tplayers.cli.checks import _TiedLM
    from tplayers.testing import dense_parameters

    p = tplayers.resolve_group(group).size
    torch.manual_seed(seed)
    h, seq, vocab = 16 * p, 4 * p, 8 * p + 3
    dense = _TiedLM(nn.Embedding(vocab, h), nn.Linear(h, vocab, bias=False)).to(torch.bfloat16)
    tp = _TiedLM(VocabParallelEmbedding.from_dense(dense.embed, group=group),
                 ParallelLMHead.from_dense(dense.head, group=group, gather_output=True))
    exact = _TiedLM(nn.Embedding(vocab, h), nn.Linear(h, vocab, bias=False)).double()
    exact.embed.weight.data.copy_(dense.embed.weight.double())
    ids = torch.randint(0, vocab, (2, seq))
    grad = torch.randn((2, seq, vocab), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for module in (dense, tp, exact):
        module(ids).backward(grad.to(next(module.parameters()).dtype))
    d, x = dense.embed.weight.grad.double(), exact.embed.weight.grad
    t = dense_parameters(tp, grads=True)["embed.weight"].double()
    outside = [(tuple(i), float(d[tuple(i)]), float(t[tuple(i)]), float(x[tuple(i)]))
               for i in (~torch.isclose(t, d, rtol=0.04, atol=0.04)).nonzero().tolist()]
    return float((d - x).abs().max()), float((t - x).abs().max()), float(x.abs().max()), outside


def main() -> None:
    from tplayers.testing import World

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--seeds", default="0,1,2,3")
    args = ap.parse_args()
    with World(args.tp) as world:
        for seed in (int(s) for s in args.seeds.split(",")):
            dense_err, tp_err, largest, outside = world.run(_rank, seed)[0]
            print(f"seed {seed}: max |dense - exact| {dense_err:.3f}, max |TP - exact| {tp_err:.3f} (x{tp_err / dense_err:.2f}),"
                  f" largest |gradient| {largest:.1f}; outside rtol=atol=0.04 of dense: "
                  + ("; ".join(f"{i} dense {a:.4f} TP {b:.4f} exact {c:.4f}" for i, a, b, c in outside) or "none"))


if __name__ == "__main__":
    main()
