"""Parameters each rank holds / the dense model's, after `parallelize(model, "auto")`, for Hugging Face
MoE families at their default configs (the published models' sizes), two decoder layers, built on the
meta device (no weights allocated). COUNTED: deterministic.

    PYTHONPATH=. python benchmarks/moe_memory.py [--tp 2] [--experts ffn|whole|all_to_all] [family ...]
"""
from __future__ import annotations

import argparse
import warnings

import torch

import tplayers
from tplayers.testing import World

DEFAULT = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "granitemoe", "llama4_text", "deepseek_v3"]


def _build(model_type: str):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[model_type]()
    config.num_hidden_layers = 2
    if hasattr(config, "first_k_dense_replace"):
        config.first_k_dense_replace = 0  # both layers MoE
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _rank(group, families, experts):
    out = {}
    for family in families:
        try:
            model = _build(family)
            dense = sum(p.numel() for p in model.parameters())
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "covers only part": reported below
                tplayers.parallelize(model, "auto", group=group, audit=False, experts=experts)
            held = sum(p.numel() for p in model.parameters())
            out[family] = f"{held / dense:.3f} of {dense / 1e9:.2f} B"
        except Exception as e:  # a family this transformers cannot build on meta, or tplayers refuses
            out[family] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("families", nargs="*", default=DEFAULT)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--experts", default="ffn", choices=["ffn", "whole", "all_to_all"])
    args = ap.parse_args()
    with World(args.tp) as world:
        out = world.run(_rank, args.families, args.experts)[0]
    print(f"COUNTED, TP {args.tp}, experts={args.experts!r}: parameters per rank / dense (2 layers, default configs)")
    for family, figure in out.items():
        print(f"  {family:20s} {figure}")


if __name__ == "__main__":
    main()
