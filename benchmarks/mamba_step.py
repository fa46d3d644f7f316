"""A Granite-4.0-H-like model's training step at TP 2 with its Mamba-2 mixers split by heads (`ParallelMamba2`,
style `MambaMixer`) against the same model with the mixers whole on every rank (what "auto" did before): step
time, parameter bytes per rank, and the collectives the split mixers add per rank and step (`comm_accounting`:
this arm's step minus the whole mixers' step; on the wire a ring all-reduce sends 2(p-1)/p of its buffer;
counted once outside the timed steps). Two layouts
of B and C: one group held whole by both ranks (Granite 4.0's), and groups split with the heads (Nemotron-H's:
Megatron's layout).

Real gloo on this machine's cores. The models are built from the same dense weights and run in one process,
alternating step by step (`tplayers.bench.timing.time_steps`); the paired median ratio (and quartiles) of each
arm / whole mixers, slower rank.

    PYTHONPATH=. python benchmarks/mamba_step.py [--layers 2] [--tp 2] [--repeats 10]
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch

import tplayers
from tplayers.bench.budget import wire_bytes
from tplayers.bench.report import quartiles
from tplayers.convert import MambaMixer, auto_plan
from tplayers.bench.timing import time_steps
from tplayers.testing import World


def _model(layers: int, groups: int):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                                    num_attention_heads=8, num_key_value_heads=8, num_local_experts=4,
                                    num_experts_per_tok=2, shared_intermediate_size=512, layer_types=["mamba"] * layers,
                                    mamba_n_heads=16, mamba_d_head=32, mamba_n_groups=groups, mamba_d_state=64,
                                    mamba_chunk_size=64, max_position_embeddings=512, experts_implementation="eager")
    torch.manual_seed(0)
    return GraniteMoeHybridForCausalLM(config)


def _rank(group, layers: int, repeats: int):
    dense = {g: _model(layers, g) for g in (1, 2)}
    whole_plan = auto_plan(dense[1]).plan
    whole_plan.layers = {k: ("replicate" if isinstance(v, MambaMixer) else v) for k, v in whole_plan.layers.items()}
    kw = dict(group=group, audit=False, check_inputs=0)
    models = {"heads, one group": tplayers.parallelize(copy.deepcopy(dense[1]), "auto", **kw),
              "heads, groups split": tplayers.parallelize(copy.deepcopy(dense[2]), "auto", **kw),
              "whole": tplayers.parallelize(copy.deepcopy(dense[1]), whole_plan, **kw)}
    ids = torch.randint(0, 4096, (2, 256), generator=torch.Generator().manual_seed(1))
    step_bytes, step_counts = {}, {}
    for name, model in models.items():  # every collective of one step; the mixers' = this arm's - whole mixers'
        with tplayers.comm_accounting(model) as acc:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
        step_bytes[name] = sum(wire_bytes(r.op, r.nbytes, r.group_size) for r in acc.records)
        step_counts[name] = len(acc.records)
    def step(model):
        def run():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)
        return run

    timings = time_steps({k: step(m) for k, m in models.items()}, group=group, iters=repeats, warmup=2)
    step = {k: 1e3 * torch.tensor(t.times) for k, t in timings.items()}  # ms per round, the slower rank
    dense_bytes = sum(p.numel() * p.element_size() for p in dense[1].parameters())
    out = {}
    for k, m in models.items():
        q = quartiles((step[k] / step["whole"]).tolist())
        held = sum(p.numel() * p.element_size() for p in m.parameters()) / dense_bytes
        out[k] = (statistics.median(step[k].tolist()), q, held, step_bytes[k] - step_bytes["whole"],
                  step_counts[k] - step_counts["whole"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    with World(args.tp) as world:
        out = world.run(_rank, args.layers, args.repeats)[0]
    print(f"TP {args.tp} over gloo (CPU), Granite-MoE-Hybrid-like {args.layers} Mamba layers (hidden 256, 16 heads x "
          f"32, state 64, 4 experts of ffn 512, batch 2 x 256 tokens, float32), {args.repeats} rounds, slower rank:")
    for name, (median, (ratio, low, high), held, moved, count) in out.items():
        print(f"  mixers {name:20s} step {median:7.1f} ms (median); paired / whole {ratio:.3f}x "
              f"(quartiles {low:.3f}-{high:.3f}); parameters per rank / dense {held:.3f}; "
              f"collectives added {count}, {moved / 1e6:.3f} MB on the wire per step (rank 0)")


if __name__ == "__main__":
    main()
