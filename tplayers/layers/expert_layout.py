"""How a Hugging Face-style experts module is cut (:class:`~tplayers.layers.experts.ParallelExperts`): each
parameter's split (``ExpertSplit``), what a dispatch and a layout refuse, the placements (an ffn the TP degree
does not divide cut as evenly as possible).
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.nn as nn

from ..core.groups import TPGroup
from ..core.placement import Placement, Sharded

__all__ = ["ExpertSplit", "check_dispatch", "check_params", "expert_placements", "forward_inputs"]


#: (parameter name, dim, parts): how one parameter of the experts is cut (parts=2 for a packed [gate; up])
ExpertSplit = Tuple[str, int, int]


def forward_inputs(cls: type) -> List[str]:
    """The names of the positional inputs of ``cls.forward`` (after self); a ``*args`` counts as three."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return ["*args"] * 3
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def check_dispatch(dense: nn.Module, what: str, splits: Sequence[ExpertSplit], dispatch: str,
                    sequence_parallel: bool) -> Tuple[bool, Any]:
    """Whether the experts go whole per rank (every split along dim 0), and their count; or a ValueError
    naming what this dispatch / layout cannot do (with this transformers, this forward)."""
    whole = bool(splits) and all(dim == 0 for _, dim, _ in splits)
    if dispatch not in ("all_reduce", "all_to_all"):
        raise ValueError(f"{what}: dispatch={dispatch!r}; choose 'all_reduce' or 'all_to_all'")
    if dispatch == "all_to_all" and not whole:
        raise ValueError(f"{what}: dispatch='all_to_all' sends tokens to whole experts: cut every parameter "
                         "along dim 0 (whole experts per rank)")
    if sequence_parallel and dispatch != "all_to_all":
        raise ValueError(f"{what}: sequence_parallel=True (each rank its own tokens) needs dispatch='all_to_all': "
                         "the all-reduce dispatch sums partial outputs of the same tokens")
    if whole and any(parts != 1 for _, _, parts in splits):
        raise ValueError(f"{what}: whole experts per rank (dim 0) are cut in one part")
    if any(dim == 0 for _, dim, _ in splits) and not whole:
        raise ValueError(f"{what}: either every parameter is cut along dim 0 (whole experts per rank) or none is")
    experts = getattr(dense, "num_experts", None)
    if whole and not (isinstance(experts, int) and all(params_shape0 == experts for params_shape0 in
                                                        (p.shape[0] for p in dense.parameters(recurse=False)))):
        raise ValueError(f"{what}: whole experts per rank need the module's num_experts (got {experts!r}) to "
                         "count its parameters' first dim")
    if (whole and dispatch == "all_reduce" and type(dense).__module__.startswith("transformers.")
            and not hasattr(dense, "_is_expert_parallel")
            and getattr(getattr(dense, "config", None), "_experts_implementation", None) in (None, "eager")):
        import transformers  # (a transformers class: the package is there)

        raise ValueError(f"{what}: whole experts per rank route other ranks' tokens to the sentinel expert id "
                         f"num_experts, which transformers' eager experts skip from the version that has expert "
                         f"parallelism (_is_expert_parallel); transformers {transformers.__version__} has not (its "
                         "eager experts one-hot the ids over num_experts and fail). Upgrade transformers, or send "
                         "the tokens to the experts (experts='all_to_all'), or split each expert's ffn "
                         "(experts='ffn')")
    if whole and len(forward_inputs(type(dense))) < 3:
        raise ValueError(f"{what}: whole experts per rank need a forward of (hidden_states, top_k_index, "
                         f"top_k_weights) that runs each token on the experts it is routed to; "
                         f"{type(dense).__name__}.forward takes {forward_inputs(type(dense))} (every expert "
                         "sees every token it is given): split each expert's ffn instead (experts='ffn')")
    return whole, experts


def check_params(dense: nn.Module, what: str, splits: Sequence[ExpertSplit], added_once: Sequence[str],
                  whole: bool) -> Tuple[Dict[str, nn.Parameter], Tuple[str, ...]]:
    """The experts' own parameters, every one split or added once (or a ValueError naming the others)."""
    params = dict(dense.named_parameters(recurse=False))
    names = [s[0] for s in splits]
    added_once = tuple(added_once)
    if whole and added_once:
        raise ValueError(f"{what}: with whole experts per rank every parameter is cut along dim 0 (a bias too); "
                         f"added_once={list(added_once)} is for experts whose ffn is split")
    if set(added_once) & set(names) or not set(added_once) <= set(params):
        raise ValueError(f"{what}: added_once={list(added_once)} must name parameters of the experts that "
                         f"splits does not (splits: {names})")
    unsplit = sorted(set(dict(dense.named_parameters())) - set(names) - set(added_once))
    if not splits or unsplit:
        raise ValueError(f"{what}: every parameter of the experts must be split (got splits for {names}); "
                         f"not split: {unsplit}. A parameter added after the partial sums (a bias of the "
                         "down projection) cannot be split: name it in added_once")
    return params, added_once


def expert_placements(what: str, splits: Sequence[ExpertSplit], params: Dict[str, nn.Parameter], whole: bool, g: TPGroup,
                added_once: Tuple[str, ...]) -> Tuple[Dict[str, Placement], List[str], Any, Optional[int]]:
    """Each parameter's placement; an ffn the TP degree does not divide cut as evenly as possible (the
    names cut so, the part, the ffn size)."""
    part, ffn_size = None, None
    placements: Dict[str, Placement] = {}
    for name, dim, parts in splits:
        p = params.get(name)
        if p is None or not -p.dim() <= dim < p.dim() or parts < 1 or p.shape[dim] % parts:
            raise ValueError(f"{what}: cannot cut parameter '{name}' "
                             f"{tuple(p.shape) if p is not None else '(missing)'} along dim {dim} into {parts} "
                             "parts")
        dim = dim % p.dim()
        placements[name] = Sharded.fused(dim, [p.shape[dim] // parts] * parts, g.size,
                                         layer=f"{what}.{name}", names=[f"dim {dim}"] * parts) \
            if whole or (p.shape[dim] // parts) % g.size == 0 else None
    uneven = [n for n, pl in placements.items() if pl is None]
    if uneven:  # an ffn that does not divide the TP degree: each part as evenly as possible, padded
        ffn = {params[n].shape[d] // k for n, d, k in splits}
        if len(ffn) != 1 or added_once:
            raise ValueError(f"{what}: the ffn does not divide the TP degree {g.size} ({', '.join(uneven)}); "
                             "cut unevenly only when every split is the ffn or a packed [gate; up] of it (here "
                             f"{sorted(ffn)}) and nothing is added after the partial sums")
        (ffn_size,) = ffn
        part = Sharded.balanced(0, ffn_size, g.size).parts[0]
        for name, dim, parts in splits:
            placements[name] = Sharded(dim % params[name].dim(), (part,) * parts)
    return placements, uneven, part, ffn_size
