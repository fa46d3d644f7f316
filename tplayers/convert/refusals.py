"""What ``parallelize`` refuses before it changes anything: a plan that does not fit the model (patterns for
another family, nothing matched, a row layer no column feeds, a column whose split output reaches a whole
layer), ranks whose dense models differ, and the MoE router's load-balancing loss on sequence chunks.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn

from ..core.blocking import bit_hash, ranks_that_differ
from ..core.groups import TPGroup
from ..layers.base import TensorParallelModule
from .plan import Plan
from .styles import Built, Style

__all__ = ["check_same_dense_model", "refuse_lonely_columns", "refuse_lonely_rows", "refuse_no_match",
           "refuse_router_logits_argument", "refuse_router_logits_in_config", "refuse_unfitting_plan"]


_ROUTER_LOGITS = ("the load-balancing loss of transformers' MoE models (output_router_logits=True) averages the router "
                  "over every token of the batch; under sequence parallelism each rank routes its own chunk, so the "
                  "loss would be each chunk's, not the batch's")


def refuse_router_logits_in_config(model: nn.Module, experts: List[str]) -> None:
    """MoE experts on sequence chunks (``experts``): refuse a model whose config adds the router's
    load-balancing loss to its loss (it would be each rank's chunk's)."""
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    configs = [config, get_text() if callable(get_text) else None, getattr(config, "text_config", None)]
    if any(getattr(c, "output_router_logits", False) for c in configs if c is not None):
        raise ValueError(f"parallelize(..., sequence_parallel=True): MoE experts {experts[:2]}: {_ROUTER_LOGITS}; set "
                         "config.output_router_logits=False or use sequence_parallel=False")


def refuse_router_logits_argument(model: nn.Module, experts: List[str]) -> None:
    """The same at every call: a forward given ``output_router_logits=True`` raises."""
    def pre_hook(module: nn.Module, args: Any, kwargs: Dict[str, Any]) -> None:
        if kwargs.get("output_router_logits"):
            raise ValueError(f"{type(module).__name__}(output_router_logits=True) with MoE experts {experts[:2]} on "
                             f"sequence chunks (parallelize(..., sequence_parallel=True)): {_ROUTER_LOGITS}; call it "
                             "without output_router_logits, or parallelize with sequence_parallel=False")
    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


def refuse_unfitting_plan(model: nn.Module, plan_name: str, styles: Dict[str, Style], used: set) -> None:
    """A shipped plan most of whose patterns match nothing was written for another family's module names (the
    "llama" plan on Phi or OPT: q/k/v split, no row layer after them, a shape error inside the model)."""
    missing = [pat for pat in styles if pat not in used]
    if len(missing) * 2 > len(styles):
        raise ValueError(f"parallelize: plan '{plan_name}' does not fit {type(model).__name__}: {len(missing)} of its "
                         f"{len(styles)} patterns match no module ({missing[:4]}; only {sorted(used)[:4]} match): it "
                         "was written for the module names "
                         f"of the '{plan_name}' family. Use 'auto' (the model's own tp_plan, for Hugging Face models) "
                         "or a plan of your own (docs/models.md)")


def refuse_no_match(model: nn.Module, modules: Dict[str, nn.Module], built: Dict[str, Built],
                     styles: Dict[str, Style], plan: Plan) -> None:
    if not any(b.module is not modules[n] or b.finish is not None for n, b in built.items()):
        raise ValueError(f"parallelize: plan '{plan.name}' matched no module of {type(model).__name__} "
                         f"(patterns {list(styles)}); module names look like {list(modules)[1:6]}")


def check_same_dense_model(model: nn.Module, tp: TPGroup) -> None:
    """Every rank must hold the same dense weights: each shards its own copy, so copies that differ
    would be stitched into a model no rank ever had. One all-gather of two hashes per tensor."""
    tp_owned = {f"{m}." for m, mod in model.named_modules() if isinstance(mod, TensorParallelModule) and m}
    tensors = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if t.device.type != "meta"  # a meta model gets its weights later (load_dense)
               and not any(n.startswith(prefix) for prefix in tp_owned)]  # already sharded: differ by design
    if tp.size == 1 or not tensors:
        return
    differ = ranks_that_differ(torch.stack([bit_hash(t) for _, t in tensors]), group=tp)  # (p, n)
    if differ.any():
        ranks, index = differ.nonzero()[0].tolist()
        raise ValueError(f"parallelize: '{tensors[index][0]}' differs between rank 0 and rank {ranks} of the TP group: "
                         "every rank must start from the same dense model (build it under the same seed, or load "
                         "the same checkpoint, on every rank); check_consistency=False skips this check")


def refuse_lonely_rows(model: nn.Module, io: Dict[str, Tuple[bool, bool]], regions: List[str], plan_name: str,
                        named: bool, tp: TPGroup) -> None:
    """A row layer no column layer feeds takes its whole input as if it were this rank's shard: the
    forward crashes inside the model, or worse. A shipped or "auto" plan that leaves one is applied to a
    model it does not fit (the "llama" plan on fused ``qkv_proj`` / ``gate_up_proj``): refused. In a plan
    of your own it may be meant (you split the input yourself): a warning at TP > 1."""
    lonely = [n for n in regions if io.get(n, (False, False))[0]]
    if not lonely:
        return
    msg = (f"parallelize: plan '{plan_name}': row-parallel {lonely[:3]} {'have' if len(lonely) > 1 else 'has'} no "
           "column-parallel layer feeding it in any enclosing module, so it would take its whole input as this rank's "
           "shard")
    if named:
        raise ValueError(f"{msg}: the plan does not fit {type(model).__name__} (are its q/k/v or gate/up projections "
                         "fused, or named differently?); give a plan of your own")
    if tp.size > 1:  # (a world of one splits nothing)
        warnings.warn(f"{msg}; make sure its input arrives split on the last dim", stacklevel=4)


def refuse_lonely_columns(model: nn.Module, lonely: List[str], built: Dict[str, Built], plan_name: str,
                           tp: TPGroup) -> None:
    """A column layer whose split output no row layer takes (none in any enclosing module), beside a linear
    layer the plan left whole, hands that layer this rank's shard of its features as if it were the whole: a
    crash inside the model, or worse (nanochat's MLP with ``c_proj`` left out of the plan). Refused at TP > 1.
    A lone column with no such neighbour is a model's split output (its caller takes the shard: logits for a
    vocabulary-parallel loss), as before."""
    if tp.size == 1:
        return
    modules = dict(model.named_modules())
    for name in lonely:
        parent = name.rpartition(".")[0]
        whole = [f"{parent}.{c}" if parent else c for c, m in modules[parent].named_children()
                 if isinstance(m, nn.Linear) and (f"{parent}.{c}" if parent else c) not in built]
        if whole:
            raise ValueError(
                f"parallelize: plan '{plan_name}': column-parallel '{name}' has no row-parallel layer after it in any "
                f"enclosing module, and its neighbour {whole[:3]} (an nn.Linear the plan leaves whole) would take "
                "this rank's shard of its output features as the whole. Add the layer that consumes it to the plan as "
                "'row' (an MLP's down projection, an attention's output projection), or gather its output "
                "(Column(gather_output=True))")
