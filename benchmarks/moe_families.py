"""Per-rank parameters / dense for every Mixture-of-Experts family transformers ships, after
``parallelize(model, "auto")``: the families whose config has an experts count, built on the meta device
from their default configs (the published sizes) with two decoder layers (the ratio is per layer), at each
TP degree asked for. COUNTED: parameter elements, no forward. A family that cannot be built from its
default config, or that "auto" refuses, is listed with the first line of the error.

    PYTHONPATH=. python benchmarks/moe_families.py [--tp 2 4] [FAMILY ...]
"""
from __future__ import annotations

import argparse
import warnings
from typing import Dict, List, Union

import torch

import tplayers
from tplayers.testing import World

_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def moe_families() -> List[str]:
    """The causal-LM model types whose default (text) config has an experts count."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = CONFIG_MAPPING[model_type]()
            text = config.get_text_config()
        except Exception:  # (configs that need arguments, ambiguous text configs)
            continue
        if any(getattr(text, k, None) for k in _EXPERT_COUNTS):
            out.append(model_type)
    return out


def _meta_model(model_type: str) -> torch.nn.Module:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[model_type]()
    text = config.get_text_config()
    for k in ("num_hidden_layers", "num_layers"):
        if hasattr(text, k):
            setattr(text, k, 2)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _fractions(group, families: List[str]) -> Dict[str, Union[float, str]]:
    warnings.filterwarnings("ignore")
    out: Dict[str, Union[float, str]] = {}
    for family in families:
        try:
            model = _meta_model(family)
        except Exception as e:
            out[family] = f"not built from its default config: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
            continue
        dense = sum(p.numel() for p in model.parameters())
        try:
            tplayers.parallelize(model, "auto", group=group, audit=False)
        except Exception as e:
            out[family] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            continue
        out[family] = sum(p.numel() for p in model.parameters()) / dense
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("families", nargs="*")
    args = ap.parse_args()
    families = args.families or moe_families()
    results = {}
    for tp in args.tp:
        with World(tp) as world:
            results[tp] = world.run(_fractions, families)[0]
    print(f"COUNTED: per-rank parameters / dense after parallelize(model, 'auto'), {len(families)} MoE families "
          f"(default configs, 2 layers, meta device), TP {', '.join(map(str, args.tp))}")
    for family in families:
        cells = [f"{r:.3f}" if isinstance(r, float) else r for r in (results[tp][family] for tp in args.tp)]
        print(f"  {family:<22} " + " | ".join(cells))


if __name__ == "__main__":
    main()
