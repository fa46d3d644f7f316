"""The cost of heads that do not divide the TP degree (issue 28): a Llama-like training step at TP 2 with
6, 7 and 8 heads (head_dim 64, everything else equal). 7 heads split 4 + 3: both ranks carry 4 heads' width
(rank 1's fourth is zero padding), so the step should cost what 8 heads cost (the slowest rank sets it),
and an ideal 3.5-head split would cost the mean of the 6- and 8-head steps.

Real gloo on this machine's cores. The three models run in one process, alternating step by step; the
paired median ratios (and quartiles) on the slower rank.

    PYTHONPATH=. python benchmarks/uneven_step.py [--layers 2] [--tp 2] [--repeats 10]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import tplayers
from tplayers.bench.report import quartiles
from tplayers.core.blocking import all_reduce_tensor
from tplayers.testing import World

HEADS = (6, 7, 8)


def _rank(group, layers: int, repeats: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    models = {}
    for heads in HEADS:
        config = LlamaConfig(vocab_size=4096, hidden_size=504, intermediate_size=1024, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=heads, head_dim=64,
                             max_position_embeddings=512)
        torch.manual_seed(0)
        models[heads] = tplayers.parallelize(LlamaForCausalLM(config), "auto", group=group, audit=False,
                                             check_inputs=0)
    ids = torch.randint(0, 4096, (4, 256), generator=torch.Generator().manual_seed(1))
    times = {k: [] for k in models}
    for i in range(len(HEADS) * (repeats + 2)):
        heads = HEADS[i % len(HEADS)]
        t0 = time.perf_counter()
        models[heads](input_ids=ids, labels=ids).loss.backward()
        elapsed = time.perf_counter() - t0
        models[heads].zero_grad(set_to_none=True)
        if i >= 2 * len(HEADS):
            times[heads].append(1e3 * elapsed)
    step = {k: all_reduce_tensor(torch.tensor(v), group=group, op="max") for k, v in times.items()}  # slower rank

    return ({k: statistics.median(v.tolist()) for k, v in step.items()},
            {"7 / 8": quartiles((step[7] / step[8]).tolist()), "7 / 6": quartiles((step[7] / step[6]).tolist()),
             "7 / mean(6, 8)": quartiles((2 * step[7] / (step[6] + step[8])).tolist())})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    with World(args.tp) as world:
        medians, ratios = world.run(_rank, args.layers, args.repeats)[0]
    print(f"TP {args.tp} over gloo (CPU), Llama-like {args.layers} layers (hidden 504, head_dim 64, ffn 1024, "
          f"batch 4 x 256 tokens, float32), {args.repeats} rounds, slower rank:")
    for heads, median in medians.items():
        print(f"  {heads} heads: step {median:7.1f} ms (median)")
    for name, (ratio, low, high) in ratios.items():
        print(f"  paired {name}: {ratio:.3f}x (quartiles {low:.3f}-{high:.3f})")


if __name__ == "__main__":
    main()
