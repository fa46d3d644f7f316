"""What the default inputs check costs: one checked forward's hook (hash every input tensor, two
small all-gathers) against a typical step, on TP 2 CPU gloo ranks.

A batch as a Hugging Face causal LM takes it: ``input_ids``, ``attention_mask`` and ``labels``, each
(batch, seq) int64. Times one checked call of the hook (``check_same_inputs(every=1)``) and a
4-layer Llama-like TP model's forward + backward on the same batch, interleaved, medians over
``--repeats`` on the slowest rank. ``parallelize`` checks the first forward and every 1000th.

    PYTHONPATH=. python benchmarks/input_check_cost.py [--batch 8] [--seq 512] [--repeats 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

import tplayers
from tplayers.core.blocking import all_reduce_tensor
from tplayers.testing import World


def _rank(group, batch: int, seq: int, repeats: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8)
    model = tplayers.parallelize(LlamaForCausalLM(config), "auto", group=group, audit=False, check_inputs=0)
    ids = torch.randint(0, 4096, (batch, seq), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    probe = nn.Identity()
    tplayers.check_same_inputs(probe, group=group, every=1)
    check_ms, step_ms = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        probe(inputs)  # the hook runs, then Identity
        t1 = time.perf_counter()
        model(**inputs).loss.backward()
        t2 = time.perf_counter()
        check_ms.append(1e3 * (t1 - t0))
        step_ms.append(1e3 * (t2 - t1))
    slowest = lambda v: all_reduce_tensor(torch.tensor(statistics.median(v)), group=group, op="max").item()  # noqa: E731
    return slowest(check_ms), slowest(step_ms)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    with World(2) as world:
        check, step = world.run(_rank, args.batch, args.seq, args.repeats)[0]
    print(f"TP 2, CPU gloo, batch {args.batch} x seq {args.seq} (3 int64 tensors): one checked forward's hook "
          f"{check:.3f} ms; a 4-layer Llama-like step {step:.1f} ms; the check is {100 * check / step:.2f}% of a checked "
          f"step, {100 * check / step / 1000:.4f}% of steps at every=1000 (medians of {args.repeats}, slowest rank)")


if __name__ == "__main__":
    main()
