"""A separate-q/k/v plan written by a user (a dict of layer patterns, no "auto") on HF Llama: one counted step's
wire bytes against Megatron's budget, in float32 and under bf16 autocast (COUNTED: comm_accounting, not timed).

    PYTHONPATH=. python benchmarks/own_plan_budget.py [--tp 2] [--layers 2]
"""
from __future__ import annotations

import argparse
import contextlib

import torch

import tplayers
from tplayers.testing import World

PLAN = {"model.embed_tokens": "vocab_embedding", "lm_head": "vocab_head",
        "model.layers.*.self_attn.q_proj": "column", "model.layers.*.self_attn.k_proj": "column",
        "model.layers.*.self_attn.v_proj": "column", "model.layers.*.self_attn.o_proj": "row",
        "model.layers.*.mlp.gate_proj": "column", "model.layers.*.mlp.up_proj": "column",
        "model.layers.*.mlp.down_proj": "row"}


def _rank(group, layers: int, autocast: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = tplayers.parallelize(LlamaForCausalLM(config), PLAN, group=group, loss_parallel=True)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    mixed = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    with mixed():
        model(ids, labels=ids).loss.backward()  # the audit's step
    with tplayers.comm_accounting(model) as acct, mixed():
        model(ids, labels=ids).loss.backward()
    budget = tplayers.megatron_budget_for_hf(model, tuple(ids.shape), tp_size=group.size(), loss_parallel=True,
                                             dtype=torch.bfloat16 if autocast else None)
    return str(acct.against(budget))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    with World(args.tp) as world:
        for autocast in (False, True):
            print(f"own separate-q/k/v plan, HF Llama {args.layers} layers, TP {args.tp}, "
                  f"{'bf16 autocast' if autocast else 'float32'}:")
            print(world.run(_rank, args.layers, autocast)[0])


if __name__ == "__main__":
    main()
