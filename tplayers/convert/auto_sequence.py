"""The sequence-parallel variant of an ``"auto"`` plan, derived from the model's module tree
(:func:`sequence_parallel_auto`): the layout of the shipped ``"llama"`` SP plan, for any decoder-only model whose
decoder layers sit in one ``nn.ModuleList``.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Union

import torch.nn as nn

from .plan import Plan, resolve_style, sequence_parallel_variant
from .sequence import ReplicateReduceGrad
from .styles import Column, KVColumn, Replicate, Row, Style
from .styles_whole import Experts

__all__ = ["sequence_parallel_auto"]


def _is_norm(module: nn.Module) -> bool:
    """A normalization layer (``nn.LayerNorm`` or a family's RMSNorm / LayerNorm class): per-token, so it runs on
    a sequence chunk as it does on the whole sequence."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def sequence_parallel_auto(model: nn.Module, plan: Plan) -> Plan:
    """The sequence-parallel variant of ``model``'s ``"auto"`` plan (Korthikanti et al., as the shipped
    ``"llama"`` plan's): the first decoder layer scatters the residual stream along the sequence; the norms
    directly inside each decoder layer run on this rank's chunk (their gradients summed); each attention takes
    the gathered sequence (q/k/v stay plain column layers, its output projection reduce-scatters); the MLP's
    column layers all-gather their input once and its row layer reduce-scatters; the final norm gathers.

    Derived from the module tree, for decoder-only models whose decoder layers sit in one ``nn.ModuleList``,
    each holding an attention the plan splits by heads and norms and MLPs as direct children. An MoE block runs
    on the chunk too when its experts send their tokens by all-to-all (``experts="all_to_all"``): each rank
    dispatches its own tokens, its router's (and any replicated module's) gradients are summed, shared experts
    gather once and reduce-scatter like any MLP. Anything else is refused, naming the module and why (MoE experts
    whose partial outputs are all-reduced, which take every rank's tokens; modules with parameters the variant
    does not know; a model without a final norm after its layers)."""
    modules = dict(model.named_modules())
    attention = sorted(plan.set_attrs)
    where = "parallelize(model, 'auto', sequence_parallel=True)"
    if not attention:
        raise ValueError(f"{where}: the plan splits no attention by heads, so there are no decoder layers to put in a "
                         "sequence-parallel region; use sequence_parallel=False or a plan of your own")
    blocks = sorted({a.rpartition(".")[0] for a in attention})
    lists = sorted({b.rpartition(".")[0] for b in blocks})
    container = modules.get(lists[0]) if len(lists) == 1 else None
    if not isinstance(container, nn.ModuleList) or len(container) != len(blocks):
        raise ValueError(f"{where}: the split attentions {attention[:2]}... are not one per decoder layer of a single "
                         f"ModuleList (found {lists}); use sequence_parallel=False or a plan of your own")
    norms: List[str] = []
    gather: List[str] = []
    keep: List[str] = []
    moe: Dict[str, Style] = {}  # MoE blocks' styles on sequence chunks
    for block in blocks:
        for child_name, child in modules[block].named_children():
            name = f"{block}.{child_name}"
            inside = {n: st for n, st in plan.layers.items() if n.startswith(name + ".") or n == name}
            if name in attention:
                gather.append(name)
                keep += [n for n, st in inside.items() if isinstance(st, (Column, KVColumn))]
            elif _is_norm(child):
                norms.append(name)
            elif any(isinstance(st, Experts) for st in inside.values()):
                moe.update(_moe_on_sequence_chunks(name, inside, modules, where))
            elif inside and all(type(st) in (Column, Row, ReplicateReduceGrad) for st in inside.values()):
                # an MLP: its column layers gather once, its row layer reduce-scatters; between them (the whole
                # sequence, split features) an activation's learnable scalars have their gradients summed as before
                continue
            elif inside:
                odd = sorted({type(st).__name__ if not isinstance(st, str) else st for st in inside.values()
                              if type(st) not in (Column, Row, ReplicateReduceGrad)})
                raise ValueError(f"{where}: '{name}' holds layers styled {odd}; sequence parallelism covers attention, "
                                 "dense MLPs (column and row layers) and norms only (MoE experts and their router take "
                                 "every rank's tokens); use sequence_parallel=False")
            elif any(True for _ in child.parameters()):
                raise ValueError(f"{where}: '{name}' ({type(child).__name__}) has parameters outside the plan; the "
                                 "variant does not know whether it works on a sequence chunk; use sequence_parallel=False "
                                 "or a plan of your own")
    base, _, leaf = lists[0].rpartition(".")
    children = list(modules[base].named_children())
    after = children[[n for n, _ in children].index(leaf) + 1:]  # registered after the layers
    final = [f"{base}.{n}" if base else n for n, child in after if _is_norm(child)]
    if len(final) != 1:
        raise ValueError(f"{where}: {len(final)} norms registered after '{lists[0]}' in '{base or type(model).__name__}' "
                         f"({final}); the variant gathers the sequence at the one final norm; use "
                         "sequence_parallel=False or a plan of your own")
    if moe:  # (exact names first: a module takes the first pattern that matches it)
        plan = dataclasses.replace(plan, layers={**moe, **{k: v for k, v in plan.layers.items() if k not in moe}})
    return sequence_parallel_variant(plan, [blocks[0]], norms, final, gather_inputs=gather, keep=keep)


def _moe_on_sequence_chunks(name: str, inside: Dict[str, Union[str, Style]], modules: Dict[str, nn.Module],
                            where: str) -> Dict[str, Style]:
    """The styles of MoE block ``name`` (its plan entries ``inside``) inside a sequence-parallel region, where it
    runs on this rank's chunk of the sequence: experts sent their tokens by all-to-all (each rank its own), dense
    MLPs beside them (shared experts) as any MLP of the region (gather once, reduce-scatter), and every replicated
    module with parameters (the router, a shared expert's gate) its gradients summed over the group (each rank's
    covers its own tokens only). Experts whose partial outputs are all-reduced take every rank's tokens: refused."""
    out: Dict[str, Style] = {}
    for n, value in inside.items():
        st = resolve_style(value, n)
        if isinstance(st, Experts):
            if st.dispatch != "all_to_all":
                raise ValueError(f"{where}: '{n}' holds MoE experts whose partial outputs are summed over the ranks "
                                 "(experts='ffn' or 'whole'), so each rank needs every token; use experts='all_to_all' "
                                 "(each rank sends its own chunk's tokens to the experts' ranks) or "
                                 "sequence_parallel=False")
            out[n] = dataclasses.replace(st, sequence_parallel=True)
        elif isinstance(st, Replicate):
            out[n] = ReplicateReduceGrad()
        elif not isinstance(st, (Column, Row, ReplicateReduceGrad)):
            raise ValueError(f"{where}: '{n}' inside the MoE block '{name}' is styled {type(st).__name__}; on a "
                             "sequence chunk an MoE block holds all-to-all experts, dense MLPs (column and row layers) "
                             "and replicated modules only; use sequence_parallel=False")
    split = [n for n in inside if n not in out or isinstance(out[n], Experts)]  # layers that handle their own
    for n, m in modules.items():
        if (n == name or n.startswith(name + ".")) and n not in split and m._parameters and \
                not any(n.startswith(s + ".") for s in split):
            out[n] = ReplicateReduceGrad()  # a router the plan leaves whole: its gradient is a partial sum now
    return out
