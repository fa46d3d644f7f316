"""The "auto" plan: a Hugging Face model's own tensor-parallel plan, translated to tplayers styles.

transformers models carry their plan as data: ``config.base_model_tp_plan`` (the base model's
modules, e.g. ``"layers.*.self_attn.q_proj": "colwise"``) and the model class's ``_tp_plan`` (the
head). :func:`auto_plan` reads both, matches each key against the model's module names the way
transformers does (``*`` is one layer index, under the base model's prefix), and translates each
style name through :data:`HF_STYLES`. What we chose where transformers differs:

- the input embedding and the output head are always vocab-parallel (HF's plans leave the
  embedding replicated); a head with a bias (Phi, GPT-J, CodeGen) has it split like its weight rows;
  a head tied to the embedding stays tied;
- ``colwise`` on a ``k_proj`` / ``v_proj`` follows the KV-head rule (fewer KV heads than ranks:
  each KV head is replicated on ``p / kv`` ranks, its gradients summed), where transformers refuses;
- MoE experts (``moe_tp_experts``, 3-D parameters styled ``packed_colwise`` / ``colwise`` /
  ``rowwise`` / ``packed_rowwise``) become :class:`~tplayers.layers.experts.ParallelExperts`: each
  rank holds 1/p of every expert's ffn, the partial outputs summed by one all-reduce forward and
  one backward (style :class:`~tplayers.convert.styles_whole.Experts`); experts the plan does not split
  whole (a parameter without a style, e.g. a bias, or an identity expert inside) stay replicated:
  exact, no memory saved, and the coverage report says why (a style on any other bare parameter is
  refused);
- with whole experts per rank (``experts="whole"`` / ``"all_to_all"``), experts the tensor-parallel plan
  does not name but the expert-parallel plan does (``base_model_ep_plan``: ``ep_dispatch_experts`` over
  ``grouped_gemm`` parameters) are split by expert too (Zaya, which has no tensor-parallel plan);
- ``mla_kv_a_proj`` (multi-head latent attention) keeps the latent projections whole on every rank
  (:class:`~tplayers.convert.styles_whole.LatentKV`: the shared rotary key's gradient summed), the ``q_a_proj``
  beside it too; DeepSeek-V3's plan, which names no attention, gets DeepSeek-V2's;
- a per-head q / k norm (one head's width) beside split q / k projections that the family's plan does not name
  (GLM-4-MoE's, Qwen3-VL-MoE's) has its gradients summed over the group, as the plans that name it say
  (:func:`~tplayers.convert.heads.per_head_norms`; a norm over the projection's whole width is left to the audit);
- a composite model without a base plan (a vision-language model) is read through the plan transformers
  composes per instance from its sub-configs (``model._tp_plan``: the text tower's, the head's);
- a model without a plan of its own (GPT-2, OPT, Falcon) gets tplayers' shipped plan for its
  ``config.model_type`` (:data:`~tplayers.convert.plans.MODEL_TYPES`);
- ``sequence_parallel`` entries (norms inside a sequence-parallel region) are not applied: "auto"
  is the plain TP layout, its norms see the whole sequence; ``parallelize(model, "auto",
  sequence_parallel=True)`` derives its sequence-parallel variant (:func:`sequence_parallel_auto`).

A style name outside the table is an error naming it and the module.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch.nn as nn

from ..layers.vocab import embedding_scale
from .plan import Plan, local_attention_attrs
from .plans import MODEL_TYPES, PLANS
from .plans.hf_additions import ADDED_ONCE, FAMILY_ADDITIONS, NO_WHOLE_EXPERTS, ffn_split_from_ep_plan
from .sequence import PerHeadParams, ReplicateReduceGrad
from .heads import attention_heads, per_head_norms
from .hf_styles import EXPERTS_REPLICATED, REPLICATED_EXPERTS, SKIPPED_STYLES, translate_style
from .styles import Column, KVColumn, is_peft_saved_copies, Replicate, Row, Style
from .styles_vocab import VocabEmbedding, VocabHead
from .styles_whole import Experts, LatentKV

__all__ = ["FAMILY_ADDITIONS", "AutoPlan", "auto_plan"]

# The children of an attention module whose column split divides its heads: the attention's own
# head-count attributes then follow the local heads.
_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv",
                     "q_b_proj", "kv_b_proj")  # (the last two: multi-head latent attention)
# An MLP's column / row projections (each pair cut the same way when the ffn does not divide the TP degree)
_FFN_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2", "c_fc", "w1", "w2", "w3",
                    "dense_h_to_4h", "dense_4h_to_h")
# transformers' styles on an experts module's 3-D parameters (weights laid out (..., out, in)): the
# dim to cut, counted from the end, and the number of packed parts ([gate; up] is two)
_EXPERT_PARAM_STYLES = {"colwise": (2, 1), "packed_colwise": (2, 2), "rowwise": (1, 1), "packed_rowwise": (1, 2)}
# transformers' expert-parallel plan's style on experts' parameters (cut along the expert dim), read for whole experts
GROUPED_GEMM = "grouped_gemm"


@dataclass
class AutoPlan:
    """A :class:`Plan` for one model, with what the translation matched and left out."""

    plan: Plan
    sources: Dict[str, str]  # HF key (with prefix) -> its style name
    unmatched: List[str] = field(default_factory=list)  # HF keys that name no module of this model
    skipped: Dict[str, str] = field(default_factory=dict)  # module or parameter name -> why it is left as it is


def _hf_plan(model: nn.Module, whole_experts: bool = False) -> Dict[str, str]:
    """``{key under the model root: style}`` from the config's base plan and the class's head plan
    (empty when the model has no plan of its own); with ``whole_experts``, the experts its expert-parallel
    plan names (``base_model_ep_plan``) that the base plan does not."""
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    if base:
        base.update(FAMILY_ADDITIONS.get(getattr(config, "model_type", ""), {}))
    ep = dict(getattr(config, "base_model_ep_plan", None) or {})
    base.update(_ep_experts(ep, base) if whole_experts else
                ffn_split_from_ep_plan(ep, base, getattr(config, "model_type", "")) if base else {})
    head = dict(getattr(type(model), "_tp_plan", None) or {})
    if not base:  # a head plan alone would shard the head and nothing else
        return _instance_plan(model)
    prefix = _base_prefix(model, base)
    if prefix:  # a model with a head around the base model
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    return {**base, **head}


def _instance_plan(model: nn.Module) -> Dict[str, str]:
    """The plan transformers (>= 5) composes per instance from a composite model's sub-configs (a vision-language
    model: its text tower's plan under the tower's path, the head), keys under the model root; with the additions
    of each sub-model's family under its path. Empty when it names only the head."""
    plan = dict(vars(model).get("_tp_plan") or {})
    if not any("." in key for key in plan):
        return {}
    seen = {id(getattr(model, "config", None))}
    for path, sub in model.named_modules():  # (parents first: a config is read where it first appears)
        config = getattr(sub, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        added = FAMILY_ADDITIONS.get(getattr(config, "model_type", ""), {})
        plan.update({f"{path}.{k}": v for k, v in added.items() if f"{path}.{k}" not in plan})
    return plan


def _ep_experts(ep: Dict[str, str], base: Dict[str, str]) -> Dict[str, str]:
    """transformers' expert-parallel plan, read for whole experts per rank: an ``ep_dispatch_experts`` module
    (whole experts, tokens reach them by its dispatch) whose parameters are ``grouped_gemm`` (cut along the
    expert dim) becomes an experts module like ``moe_tp_experts``, where the tensor-parallel plan has none."""
    out: Dict[str, str] = {}
    for key, style in ep.items():
        if style != "ep_dispatch_experts" or key in base:
            continue
        out[key] = "moe_tp_experts"
        out.update({k: GROUPED_GEMM for k, st in ep.items() if st == "grouped_gemm" and k.startswith(key + ".")})
    return out


def _base_prefix(model: nn.Module, base: Dict[str, str]) -> str:
    """Where the base model's plan keys apply: under ``base_model_prefix`` as transformers does, unless
    the keys match nothing there and do match under another child (Llama 4 text: prefix
    "language_model", decoder at ``.model``). A plan matching nothing anywhere is refused."""
    names = [n for n, _ in model.named_modules() if n]
    prefix = getattr(model, "base_model_prefix", "") or ""
    candidates = ([prefix] if isinstance(getattr(model, prefix, None), nn.Module) else []) + \
        [n for n, _ in model.named_children() if n != prefix] + [""]
    patterns = [_regex(k) for k in base]

    def hits(under: str) -> int:
        lead = f"{under}." if under else ""
        return sum(any(n.startswith(lead) and pat.match(n[len(lead):]) for n in names) for pat in patterns)
    counts = {c: hits(c) for c in candidates}
    best = max(candidates, key=lambda c: counts[c])  # the first of equals: base_model_prefix when it matches
    if counts[best] == 0:
        raise ValueError(f"parallelize(model, 'auto'): none of the {len(base)} keys of {type(model).__name__}'s "
                         f"tensor-parallel plan (e.g. '{next(iter(base))}') names a module, under its base_model_prefix "
                         f"{prefix!r} or under any of {[c for c in candidates if c]}; give a plan of your own")
    return best


def _regex(key: str) -> "re.Pattern[str]":
    """transformers' matching: ``*`` stands for one layer index."""
    return re.compile(re.escape(key).replace(r"\*", r"\d+") + r"\Z")


def _unwrap(model: nn.Module, whole_experts: bool = False) -> Dict[str, str]:
    """The plan of the transformers model inside a wrapper (PEFT's ``PeftModel``), keys under its path."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    if base is model or not isinstance(base, nn.Module):
        return _hf_plan(model, whole_experts)
    path = next((n for n, m in model.named_modules() if m is base), None)
    if path is None:
        return _hf_plan(model, whole_experts)
    return {f"{path}.{k}": v for k, v in _hf_plan(base, whole_experts).items()}


def _check_experts(experts: str, model_type: Optional[str]) -> None:
    """The ``experts`` choice, refused where it does not exist or this family's experts cannot take it."""
    if experts not in ("ffn", "whole", "all_to_all"):
        raise ValueError(f"parallelize(model, 'auto'): experts={experts!r}; choose 'ffn' (each expert's ffn split "
                         "across ranks), 'whole' (whole experts per rank) or 'all_to_all' (whole experts per rank, "
                         "tokens sent to them)")
    if experts == "whole" and model_type in NO_WHOLE_EXPERTS:
        raise ValueError(f"parallelize(model, 'auto', experts='whole'): {NO_WHOLE_EXPERTS[model_type]}; use "
                         "experts='ffn' (each expert's ffn split across ranks) or experts='all_to_all' (whole experts "
                         "per rank, tokens sent to them: only this rank's expert ids reach its experts)")


def _bare_parameters(param_keys: set, params: set, split: List[str], replicated: List[str],
                     modules: Dict[str, nn.Module], hf: Dict[str, str], skipped: Dict[str, str]) -> Dict[str, List[str]]:
    """The plan's keys naming bare parameters: split with their experts, left inside replicated ones, read per
    head by their attention (sinks: the returned attention -> its parameter names), else refused."""
    per_head: Dict[str, List[str]] = {}
    for key in sorted(param_keys):  # a bare parameter: split with its experts, left inside replicated ones, else refused
        if all(any(p.startswith(e + ".") for e in split) for p in params if _regex(key).match(p)):
            continue
        names = [p for p in params if _regex(key).match(p)]
        outside = [p for p in names if not any(p.startswith(e + ".") for e in replicated)]
        owners = [_per_head_owner(p, modules, hf[key]) for p in outside]
        if outside and all(owners):
            for p, owner in zip(outside, owners):
                per_head.setdefault(owner, []).append(p.rpartition(".")[2])
            continue
        if outside:
            raise ValueError(f"parallelize(model, 'auto'): the plan gives the bare parameter '{outside[0]}' the style "
                             f"'{hf[key]}'; sharding a parameter outside a module is not supported (outside MoE "
                             "experts, which stay replicated); give a plan of your own")
        skipped[key] = EXPERTS_REPLICATED
    return per_head


def _cut_by_heads(layers: Dict[str, Union[str, Style]]) -> Tuple[List[str], List[str]]:
    """The attentions the plan splits, and those whose q_proj / o_proj it now cuts by whole heads (KV
    projections and ffn layers as evenly as possible where they do not divide); ``layers`` updated."""
    attention = sorted({n.rpartition(".")[0] for n, s in layers.items()
                        if n.rpartition(".")[2] in _HEAD_PROJECTIONS and isinstance(s, (Column, KVColumn))
                        and not getattr(s, "gather_output", False)})
    by_heads = [attn for attn in attention if layers.get(f"{attn}.q_proj") == Column()
                and layers.get(f"{attn}.o_proj") in (None, Row())]
    for attn in by_heads:  # q_proj and o_proj cut by whole heads (as evenly as possible when they do not divide)
        layers[f"{attn}.q_proj"] = Column(heads=True)
        if layers.get(f"{attn}.gate_proj") == Column():  # an output gate per query feature (AFMoE): q_proj's cut
            layers[f"{attn}.gate_proj"] = Column(heads=True)
        if f"{attn}.o_proj" in layers:
            layers[f"{attn}.o_proj"] = Row(heads=True)
        for kv in ("k_proj", "v_proj"):
            if layers.get(f"{attn}.{kv}") == KVColumn():
                layers[f"{attn}.{kv}"] = KVColumn(uneven=True)
    for name, style in list(layers.items()):  # an MLP's ffn that does not divide: as evenly as possible
        if name.rpartition(".")[2] in _FFN_PROJECTIONS and style in (Column(), Row(), Column(parts=2)):
            layers[name] = dataclasses.replace(style, uneven=True)
    return attention, by_heads


def auto_plan(model: nn.Module, experts: str = "ffn") -> AutoPlan:
    """Translate ``model``'s own transformers plan into a tplayers :class:`Plan` (see the module
    docstring); pure: reads the model, changes nothing. A PEFT ``PeftModel`` is read through to the
    model it wraps. ``experts``: how MoE experts are split, ``"ffn"`` (every expert's ffn across the
    ranks, transformers' ``moe_tp_experts``), ``"whole"`` (whole experts per rank: expert
    parallelism over the TP group, partial outputs all-reduced) or ``"all_to_all"`` (whole experts per
    rank, each rank sending its share of the routed tokens to the experts' ranks and back: transformers'
    ``ep_dispatch_experts`` with ``AllToAllEP``)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    _check_experts(experts, model_type)
    hf = _unwrap(model, whole_experts=experts != "ffn")
    if not hf:
        if model_type in MODEL_TYPES:  # no plan of its own, but tplayers ships one for its family
            return AutoPlan(plan=PLANS[MODEL_TYPES[model_type]], sources={})
        raise ValueError(f"parallelize(model, 'auto'): {type(model).__name__} has no tensor-parallel plan of its own "
                         f"(config.base_model_tp_plan is empty) and tplayers ships none for model_type "
                         f"{model_type!r} (shipped: {sorted(PLANS)}); give a plan of your own")
    modules = dict(model.named_modules())
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    matches = {key: [n for n in modules if n and _regex(key).match(n)] for key in hf}
    param_keys = {key for key in hf if not matches[key] and any(_regex(key).match(p) for p in params)}
    experts_found = [n for key, names in matches.items()
                     if hf[key] in SKIPPED_STYLES and SKIPPED_STYLES[hf[key]] == EXPERTS_REPLICATED for n in names]
    layers: Dict[str, Union[str, Style]] = {}
    skipped: Dict[str, str] = {}
    for name, why in _split_experts(modules, hf, matches, param_keys, whole=experts in ("whole", "all_to_all"),
                                    dispatch="all_to_all" if experts == "all_to_all" else "all_reduce").items():
        if isinstance(why, Experts):
            layers[name] = why
        else:
            skipped[name] = why
    split = [n for n, st in layers.items() if isinstance(st, Experts)]
    unmatched = [k for k in hf if not matches[k] and k not in param_keys]
    replicated = [e for e in experts_found if e not in split]
    per_head = _bare_parameters(param_keys, params, split, replicated, modules, hf, skipped)
    for key, names in matches.items():
        for name in names:
            if name in layers or any(name.startswith(e + ".") for e in split):  # experts split above, and inside them
                continue
            if hf[key] == "local_params" and not modules[name]._parameters:  # (MiMo's full-attention layers: no sinks)
                continue
            if any(name == e or name.startswith(e + ".") for e in replicated):
                skipped.setdefault(name, EXPERTS_REPLICATED)
            elif hf[key] in SKIPPED_STYLES:
                skipped[name] = SKIPPED_STYLES[hf[key]]
            else:
                layers[name] = translate_style(hf[key], name)
    for owner, pnames in per_head.items():  # sinks styled colwise: read for this rank's heads
        if owner in layers:
            raise ValueError(f"parallelize(model, 'auto'): module '{owner}' has the style {layers[owner]!r} and "
                             f"parameters {sorted(pnames)} styled per head; give a plan of your own")
        layers[owner] = PerHeadParams(tuple(sorted(set(pnames))))
        skipped.pop(owner, None)  # (its "local_params")
    for name in [n for n, st in layers.items() if isinstance(st, LatentKV)]:
        # the query's latent projection, like the KV one, runs whole on every rank (its output feeds q_b_proj)
        q_a = f"{name.rpartition('.')[0]}.q_a_proj"
        if q_a in modules and q_a not in layers:
            layers[q_a] = Replicate()
    _vocab_parallel_ends(model, layers, skipped)
    for name in per_head_norms(modules, [n for n in layers if n.rpartition(".")[2] in ("q_proj", "k_proj")],
                               set(layers) | set(skipped)):  # (per-head q / k norms a family's plan does not name)
        layers[name] = ReplicateReduceGrad()
    attention, by_heads = _cut_by_heads(layers)
    plan = Plan(
        name="auto", layers=layers,
        # transformers >= 4.48 reshapes with view(..., -1, head_dim); older versions, and attentions keeping
        # head counts of their own (Exaone 4, Seed-OSS, Nemotron), read these: one rule for every family.
        # fused [q; k; v] projections (GPT-NeoX's query_key_value, CodeGen's qkv_proj) and MLA's q_b / kv_b are
        # cut evenly by rows: their heads must divide the TP degree
        require_divisible={n: ("config.num_attention_heads",) for n in attention if n not in by_heads},
        set_attrs={n: local_attention_attrs for n in attention})
    return AutoPlan(plan=plan, sources={k: hf[k] for k in hf}, unmatched=unmatched, skipped=skipped)


def _per_head_owner(param: str, modules: Dict[str, nn.Module], style: str) -> Optional[str]:
    """The attention owning ``param`` when ``param`` is its own parameter styled column-wise and holds one
    value per query head along dim 0 (attention sinks, a per-head gate bias), else None."""
    owner, _, leaf = param.rpartition(".")
    module = modules.get(owner)
    p = None if module is None else module._parameters.get(leaf)
    if style not in ("colwise", "local_colwise") or p is None or p.dim() < 1:
        return None
    try:
        heads = attention_heads(module)[0]
    except AttributeError:
        return None
    return owner if heads == p.shape[0] else None


def _split_experts(modules: Dict[str, nn.Module], hf: Dict[str, str], matches: Dict[str, List[str]], param_keys: set,
                   whole: bool, dispatch: str = "all_reduce") -> Dict[str, Union[Experts, str]]:
    """Each ``moe_tp_experts`` module: an :class:`Experts` style when the plan styles every one of its
    parameters (3-D, laid out ``(experts, out, in)``) and names nothing inside it but identity experts,
    else why it stays replicated. ``whole``: split by expert (dim 0) instead of by each expert's ffn;
    ``dispatch``: how tokens reach whole experts (``ParallelExperts.from_dense``)."""
    out: Dict[str, Union[Experts, str]] = {}
    for key, names in matches.items():
        if hf[key] != "moe_tp_experts":
            continue
        for name in names:
            module, splits, missing = modules[name], [], []
            added = []
            for pname, p in module.named_parameters():
                style = next((hf[k] for k in param_keys if _regex(k).match(f"{name}.{pname}")), None)
                if style == ADDED_ONCE and "." not in pname:
                    if whole:  # per expert: cut on dim 0 with the rest
                        splits.append((pname, 0, 1))
                    else:
                        added.append(pname)
                    continue
                if whole and style == GROUPED_GEMM and "." not in pname:  # the expert-parallel plan's
                    splits.append((pname, 0, 1))
                    continue
                if "." in pname or style not in _EXPERT_PARAM_STYLES or p.dim() < 2:
                    missing.append(pname)
                    continue
                from_end, parts = _EXPERT_PARAM_STYLES[style]
                splits.append((pname, 0, 1) if whole else (pname, p.dim() - from_end, parts))
            styled = {n: hf[k] for k, ns in matches.items() for n in ns if n.startswith(name + ".")}
            identity = tuple(sorted(n[len(name) + 1:] for n, st in styled.items()
                                    if st == "moe_identity_expert" and isinstance(modules[n], nn.Identity)
                                    and "." not in n[len(name) + 1:]))
            inside = sorted(n for n in styled if n[len(name) + 1:] not in identity)
            misfit = not whole and not _ffn_layout_fits(module, splits)
            if missing or inside or not splits or (identity and whole) or misfit:
                why = (f"parameters {missing} have no split the plan gives" if missing else f"it holds {inside}" if inside
                       else "identity experts with whole experts per rank" if identity else
                       f"its parameters' shapes do not fit the styles {splits} (one hidden size)" if misfit
                       else "nothing to split")
                out[name] = f"{REPLICATED_EXPERTS}: {why} (exact, but no memory saved)"
            else:
                out[name] = Experts(splits=tuple(splits), identity_experts=identity, added_once=tuple(added),
                                    dispatch=dispatch)
    return out


def _ffn_layout_fits(module: nn.Module, splits: List[Tuple[str, int, int]]) -> bool:
    """Each expert's ffn cut where the styles say: every 3-D parameter keeps one size, the hidden, on its uncut dim
    (a layout the styles misread cuts the hidden size of one and the ffn of another)."""
    params = dict(module.named_parameters())
    return len({params[n].shape[3 - d] for n, d, _ in splits if params[n].dim() == 3 and d in (1, 2)}) <= 1


def _vocab_parallel_ends(model: nn.Module, layers: Dict[str, Union[str, Style]], skipped: Dict[str, str]) -> None:
    """The input embedding and the output head become vocab-parallel (our choice; see the module docstring);
    an embedding with a forward of its own (a normed embedding) stays as it is, the report says why."""
    by_id = {id(m): n for n, m in model.named_modules()}
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb: Optional[nn.Module] = get_in() if callable(get_in) else None
    head: Optional[nn.Module] = get_out() if callable(get_out) else None
    inner = lambda m: m.original_module if m is not None and is_peft_saved_copies(m) else m  # noqa: E731
    if isinstance(inner(emb), nn.Embedding) and id(emb) in by_id:
        try:
            embedding_scale(inner(emb))  # a scaled embedding (Gemma's) splits; any other own forward does not
        except TypeError:
            skipped[by_id[id(emb)]] = (f"{type(inner(emb)).__name__} has a forward of its own (not embedding * scale): "
                                       "kept whole on every rank")
            layers.pop(by_id[id(emb)], None)
        else:
            layers[by_id[id(emb)]] = VocabEmbedding()
    if isinstance(inner(head), nn.Linear) and id(head) in by_id:
        layers[by_id[id(head)]] = VocabHead()
