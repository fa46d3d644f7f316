"""A Hugging Face Llama training step with issue 26's collectives against the same step without them,
over the emulated link that matches an H100 + NVLink's compute / communication ratio on this machine
(EMULATION: real compute and real gloo data movement; each collective completes no earlier than the
modeled link allows).

Without ``--sequence-parallel``: ``"auto"``; "before" undeclares the siblings for its steps
(q/k/v and gate/up each all-reduce their own input gradient, `tplayers/core/siblings.py`).
With ``--sequence-parallel``: the shipped ``"llama"`` SP plan; "before" switches off for its steps what
brought it to Megatron's layout: the attention's and the LM head's columns taking the shard their module
gathered (they all-reduce a whole-sequence gradient instead), the norms' one coalesced gradient
all-reduce (one per norm instead) and the embedding's reduce-scatter (an all-reduce, then a split).

Both arms run in one process, alternating step by step. Reports the paired median ratio (and quartiles)
of after / before on the slower rank, with the backward collectives counted once per arm.

    PYTHONPATH=. python benchmarks/siblings_step.py [--layers 4] [--tp 2] [--repeats 20] [--link match:h100-nvlink]
        [--sequence-parallel]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import tplayers
from tplayers.bench.measure import resolve_link
from tplayers.bench.report import quartiles
from tplayers.core import siblings
from tplayers.regions import partial_grads
from tplayers.core.comm import copy_to_tp
from tplayers.core.blocking import all_reduce_tensor
from tplayers.core.groups import resolve_group
from tplayers.layers.siblings import COLUMN_KINDS
from tplayers.testing import World


def _switch(model, sequence_parallel: bool):
    """``switch(after)``: the step's code as after issue 26's change (True) or before it (False)."""
    take, many = siblings.ColumnInputs.take, partial_grads.copy_many_to_tp
    embedding = model.get_input_embeddings()
    declared = {m: m.siblings for m in model.modules() if isinstance(m, COLUMN_KINDS)}

    def one_each(params, group):  # "before": each norm's gradient all-reduced on its own
        return tuple(copy_to_tp(p, group=group) for p in params)

    def switch(after: bool) -> None:
        if not sequence_parallel:
            for m, s in declared.items():  # "before": no set declared, one f per layer
                m.siblings = s if after else None
            return
        siblings.ColumnInputs.take = take if after else (lambda *a: None)
        partial_grads.copy_many_to_tp = many if after else one_each
        embedding.partial_output = after
    return switch


def _rank(group, layers: int, repeats: int, link: str, sequence_parallel: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
    model = tplayers.parallelize(LlamaForCausalLM(config), "llama" if sequence_parallel else "auto", group=group,
                                 sequence_parallel=sequence_parallel, audit=False, check_inputs=0)
    ids = torch.randint(0, 4096, (4, 256), generator=torch.Generator().manual_seed(1))
    switch = _switch(model, sequence_parallel)
    times = {True: [], False: []}
    counts = {}
    with tplayers.emulated_link(resolve_link(link, resolve_group(group))):
        for i in range(2 * repeats + 4):
            after = i % 2 == 0
            switch(after)
            with tplayers.comm_accounting() as acc:
                t0 = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                elapsed = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            counts[after] = sum(1 for r in acc.records if r.phase == "backward")
            if i >= 4:
                times[after].append(1e3 * elapsed)
    switch(True)
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
    ap.add_argument("--sequence-parallel", action="store_true")
    args = ap.parse_args()
    with World(args.tp) as world:
        after, before, ratio, low, high, n_after, n_before = world.run(_rank, args.layers, args.repeats, args.link,
                                                                       args.sequence_parallel)[0]
    plan = "\"llama\" sequence-parallel" if args.sequence_parallel else "\"auto\""
    print(f"EMULATION ({args.link}), TP {args.tp}, HF Llama {args.layers} layers, {plan} (hidden 256, ffn 1024, 8 heads, "
          f"batch 4 x 256 tokens): backward collectives {n_before} -> {n_after}; step {before:.1f} -> {after:.1f} ms "
          f"(medians); paired ratio after / before {ratio:.4f}x (quartiles {low:.4f}-{high:.4f}) over "
          f"{args.repeats} pairs, slower rank")


if __name__ == "__main__":
    main()
