"""What the audit costs: the first training step after ``parallelize`` with and without it.

A 4-layer Llama-like Hugging Face model (LlamaForCausalLM), float32, TP 2 on CPU gloo ranks. Each
configuration runs in fresh rank processes (a new World), so each rank's peak resident memory
(``ru_maxrss``) belongs to that run alone. Reported per rank, slowest rank:

- the first step (forward + backward; the audit runs inside its forward) and the median of the
  next steps, with the audit on and off, interleaved over ``--repeats`` fresh worlds;
- the growth of peak RSS during the first step (on - off = what the audit holds at its peak).

    PYTHONPATH=. python benchmarks/audit_cost.py [--repeats 3] [--hidden 512] [--layers 4]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import tplayers
from tplayers.testing import World


def _rank(group, audit: bool, hidden: int, layers: int, seq: int, steps: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq)
    model = LlamaForCausalLM(config).train()
    tplayers.parallelize(model, "auto", group=group, audit=audit)
    ids = torch.randint(0, 4096, (4, seq))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    times = []
    for _ in range(1 + steps):
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - t0)
        if len(times) == 1:
            grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    audited = [r.status for r in tplayers.coverage(model).audit.regions]
    return times[0], statistics.median(times[1:]), grown / 1024, audited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    rows = {True: [], False: []}
    for _ in range(args.repeats):
        for audit in (False, True):
            with World(args.tp) as world:
                per_rank = world.run(_rank, audit, args.hidden, args.layers, args.seq, args.steps, timeout=900)
            first, steady, grown = (max(r[i] for r in per_rank) for i in range(3))
            rows[audit].append((first, steady, grown))
            if audit:
                statuses = per_rank[0][3]
    med = {a: [statistics.median(r[i] for r in rows[a]) for i in range(3)] for a in rows}
    print(f"4-layer-style Llama (hidden {args.hidden}, layers {args.layers}, seq {args.seq}, batch 4, float32), "
          f"TP {args.tp}, {args.repeats} fresh worlds per setting, medians; audited regions: {statuses}")
    print("| audit | first step (s) | later steps (s) | first / later | peak RSS growth in step 1 (MiB) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for a in (False, True):
        first, steady, grown = med[a]
        print(f"| {'on' if a else 'off'} | {first:.3f} | {steady:.3f} | {first / steady:.2f} | {grown:.1f} |")
    print(f"audit on / off, first step: {med[True][0] / med[False][0]:.2f}x; "
          f"extra peak memory: {med[True][2] - med[False][2]:.1f} MiB per rank")


if __name__ == "__main__":
    main()
