"""A Mixtral-like training step at TP 2 with the experts split (`ParallelExperts`, issue 27: each expert's
ffn across the ranks, whole experts per rank with their partial outputs all-reduced, or whole experts
per rank with the tokens sent to them by all-to-all, also under sequence parallelism: each rank's own
chunk) against the same model with the experts
replicated (what "auto" did before): step time, parameter bytes per rank, and the bytes the MoE layers'
collectives send per rank and step (`comm_accounting`, on the wire: a ring all-reduce sends 2(p-1)/p of its
buffer, an all-to-all the rows bound for other ranks; counted once outside the timed steps).

Real gloo on this machine's cores (no emulated link: the point is the compute and memory each rank
carries). Both models are built from the same dense weights and run in one process, alternating step
by step; the paired median ratio (and quartiles) of split / replicated on the slower rank.

    PYTHONPATH=. python benchmarks/moe_step.py [--layers 2] [--tp 2] [--repeats 10]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import tplayers
from tplayers.bench.budget import wire_bytes
from tplayers.bench.report import quartiles
from tplayers.convert import auto_plan
from tplayers.convert.styles import Experts
from tplayers.core.blocking import all_reduce_tensor
from tplayers.testing import World


def _rank(group, layers: int, repeats: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=4096, hidden_size=256, intermediate_size=896, num_hidden_layers=layers,
                           num_attention_heads=8, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=512, experts_implementation="eager")
    torch.manual_seed(0)
    dense = MixtralForCausalLM(config)
    replicated_plan = auto_plan(dense).plan
    replicated_plan.layers = {k: ("replicate" if isinstance(v, Experts) else v) for k, v in replicated_plan.layers.items()}
    models = {"split": tplayers.parallelize(copy.deepcopy(dense), "auto", group=group, audit=False, check_inputs=0),
              "whole": tplayers.parallelize(copy.deepcopy(dense), "auto", group=group, audit=False, check_inputs=0,
                                            experts="whole"),
              "all_to_all": tplayers.parallelize(copy.deepcopy(dense), "auto", group=group, audit=False,
                                                 check_inputs=0, experts="all_to_all"),
              "all_to_all+sp": tplayers.parallelize(copy.deepcopy(dense), "auto", group=group, audit=False,
                                                    check_inputs=0, experts="all_to_all", sequence_parallel=True),
              "replicated": tplayers.parallelize(dense, replicated_plan, group=group, audit=False, check_inputs=0)}
    ids = torch.randint(0, 4096, (4, 256), generator=torch.Generator().manual_seed(1))
    moe_bytes = {}
    for name, model in models.items():  # the experts' collectives of one step: issued by them, or their backward
        with tplayers.comm_accounting(model) as acc:
            model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        moe_bytes[name] = sum(wire_bytes(r.op, r.nbytes, r.group_size) for r in acc.records
                              if r.module.endswith("experts") or r.module in (
                                  "_CopyManyToTPBackward", "_AllToAllBackward", "_SplitRowsBackward"))
    names = list(models)
    times = {k: [] for k in models}
    for i in range(len(names) * (repeats + 2)):
        name = names[i % len(names)]
        t0 = time.perf_counter()
        models[name](input_ids=ids, labels=ids).loss.backward()
        elapsed = time.perf_counter() - t0
        models[name].zero_grad(set_to_none=True)
        if i >= 2 * len(names):
            times[name].append(1e3 * elapsed)
    slowest = lambda v: all_reduce_tensor(torch.tensor(v), group=group, op="max")  # noqa: E731
    step = {k: slowest(v) for k, v in times.items()}
    dense_bytes = sum(p.numel() * p.element_size() for p in MixtralForCausalLM(config).parameters())
    out = {}
    for k, m in models.items():
        q = quartiles((step[k] / step["replicated"]).tolist())
        held = sum(p.numel() * p.element_size() for p in m.parameters()) / dense_bytes
        out[k] = (statistics.median(step[k].tolist()), q, held, moe_bytes[k])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    with World(args.tp) as world:
        out = world.run(_rank, args.layers, args.repeats)[0]
    print(f"TP {args.tp} over gloo (CPU), Mixtral-like {args.layers} layers (hidden 256, 8 experts of ffn 896, top 2, "
          f"batch 4 x 256 tokens, float32), {args.repeats} rounds, slower rank:")
    for name, (median, (ratio, low, high), held, moved) in out.items():
        print(f"  experts {name:13s} step {median:7.1f} ms (median); paired / replicated {ratio:.3f}x "
              f"(quartiles {low:.3f}-{high:.3f}); parameters per rank / dense {held:.3f}; "
              f"MoE collectives {moved / 1e6:.2f} MB on the wire per step (rank 0)")


if __name__ == "__main__":
    main()
