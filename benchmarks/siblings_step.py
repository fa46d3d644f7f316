"""A Hugging Face Llama training step with the sibling collective (q/k/v and gate/up all-reduce their
input gradient once, `tplayers/core/siblings.py`) against the same step with one all-reduce per
projection, over the emulated link that matches an H100 + NVLink's compute / communication ratio on
this machine (EMULATION: real compute and real gloo data movement; each collective completes no
earlier than the modeled link allows).

Both arms run in one process, alternating step by step; "before" switches the sibling detection off
for its steps (the layers then each reduce their own input gradient, as before issue 26). Reports the
paired median ratio (and quartiles) of after / before on the slower rank, with the backward
collectives counted once per arm.

    PYTHONPATH=. python benchmarks/siblings_step.py [--layers 4] [--tp 2] [--repeats 20] [--link match:h100-nvlink]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import tplayers
from tplayers.bench.measure import resolve_link
from tplayers.bench.report import quartiles
from tplayers.core import functional
from tplayers.core.collectives import all_reduce_tensor
from tplayers.core.groups import resolve_group
from tplayers.testing import World


def _rank(group, layers: int, repeats: int, link: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
    model = tplayers.parallelize(LlamaForCausalLM(config), "auto", group=group, audit=False, check_inputs=0)
    ids = torch.randint(0, 4096, (4, 256), generator=torch.Generator().manual_seed(1))
    joins = functional.joins_siblings
    times = {True: [], False: []}
    counts = {}
    with tplayers.emulated_link(resolve_link(link, resolve_group(group))):
        for i in range(2 * repeats + 4):
            siblings = i % 2 == 0
            functional.joins_siblings = joins if siblings else (lambda *a: False)  # "before": one f per layer
            with tplayers.comm_accounting() as acc:
                t0 = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                elapsed = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            counts[siblings] = sum(1 for r in acc.records if r.phase == "backward")
            if i >= 4:
                times[siblings].append(1e3 * elapsed)
    functional.joins_siblings = joins
    slowest = lambda v: all_reduce_tensor(torch.tensor(v), group=group, op="max")  # noqa: E731
    after, before = slowest(times[True]), slowest(times[False])
    return (statistics.median(after.tolist()), statistics.median(before.tolist()), *quartiles((after / before).tolist()),
            counts[True], counts[False])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--link", default="match:h100-nvlink")
    args = ap.parse_args()
    with World(args.tp) as world:
        after, before, ratio, low, high, n_after, n_before = world.run(_rank, args.layers, args.repeats, args.link)[0]
    print(f"EMULATION ({args.link}), TP {args.tp}, HF Llama {args.layers} layers (hidden 256, ffn 1024, 8 heads, "
          f"batch 4 x 256 tokens): backward collectives {n_before} -> {n_after}; step {before:.1f} -> {after:.1f} ms "
          f"(medians); paired ratio after / before {ratio:.4f}x (quartiles {low:.4f}-{high:.4f}) over "
          f"{args.repeats} pairs, slower rank")


if __name__ == "__main__":
    main()
