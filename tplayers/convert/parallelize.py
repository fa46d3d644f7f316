"""Drop-in TP for existing models: swap named nn.Linear / Conv1D / nn.Embedding modules in place.

    tplayers.parallelize(model, "llama", group=tp_group)   # a Hugging Face Llama-family model
    tplayers.parallelize(model, {"*.fc1": "column", "*.fc2": "row"}, group=tp_group)

A plan maps module-name patterns (``fnmatch``: ``*`` also matches dots) to styles:

    "column"           ColumnParallelLinear, output stays sharded (feeds a "row" or heads)
    "column_gather"    ColumnParallelLinear(gather_output=True): full output (e.g. an LM head)
    "fused_qkv"        column split per component of an equal-thirds fused [q; k; v] projection
    Column(parts=..)   column split per component of any fused projection (gate/up, GQA qkv)
    "kv_column"        K/V projection of GQA: split by KV heads, or replicated KV heads when there
                       are fewer than ranks (KVColumn reads the count from the parent attention)
    "row"              RowParallelLinear, input sharded on the last dim, full output
    "vocab_embedding"  VocabParallelEmbedding (rows of the table split across ranks)
    "vocab_head"       ParallelLMHead(gather_output=True): an LM head split like the embedding
    "replicate"        left as it is (documents intent; matching it stops later patterns)
    "scatter_sequence" enter sequence parallelism: the module's input is cut along the sequence
    "gather_sequence"  the module's input is gathered along the sequence (a module that needs it whole)
    "sequence_parallel_norm"  a norm on this rank's sequence chunk (parameter grads all-reduced);
                       SequenceParallelNorm(gather_output=True) also gathers its output

``parallelize(model, "llama", group=g, sequence_parallel=True)`` uses the shipped plan's sequence-
parallel variant (Column/Row with ``sequence_parallel=True`` between ``scatter_sequence`` at the first
block and a gathering final norm).

GPT-2's ``Conv1D`` (weight stored ``(in, out)``) is accepted wherever ``nn.Linear`` is; its TP
layer converts back to a ``Conv1D`` in ``to_dense()``. Modules whose forward depends on the
local head count (``num_heads``, ``split_size``, ...) get those attributes divided by the TP
degree via the plan's ``divide_attrs``; ``require_divisible`` checks sizes the model reads from
its (shared) config. Every check runs before anything is swapped, and every error names the module.
"""
from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ..core.comm import all_reduce_tensor, gather_from_sequence, scatter_to_sequence
from ..core.groups import GroupLike, TPGroup, resolve_group
from ..layers.vocab import ParallelLMHead, VocabParallelEmbedding
from ..layers.fused import FusedColumnParallelLinear
from ..core.placement import Placement
from ..layers.base import TensorParallelModule
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..layers.conv1d import ColumnParallelConv1D, FusedColumnParallelConv1D, RowParallelConv1D, is_conv1d

__all__ = [
    "parallelize",
    "Plan",
    "Column",
    "KVColumn",
    "Row",
    "VocabEmbedding",
    "VocabHead",
    "Replicate",
    "SequenceParallelNorm",
    "ScatterSequence",
    "GatherSequence",
    "SP_PLANS",
    "PLANS",
    "get_plan",
    "ColumnParallelConv1D",
    "RowParallelConv1D",
    "FusedColumnParallelConv1D",
    "is_conv1d",
]


# ---------------------------------------------------------------------------- extra TP layers


def _part_sizes(parts: Union[int, Sequence[int]], out_features: int, where: str) -> Tuple[int, ...]:
    if isinstance(parts, int):
        if parts < 1 or out_features % parts:
            raise ValueError(f"{where}: out_features={out_features} does not split into {parts} equal parts")
        return (out_features // parts,) * parts
    sizes = tuple(int(s) for s in parts)
    if sum(sizes) != out_features:
        raise ValueError(f"{where}: part sizes {sizes} sum to {sum(sizes)}, out_features={out_features}")
    return sizes


# ---------------------------------------------------------------------------- styles


def _check_linear_like(module: nn.Module, name: str, style: str) -> None:
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise TypeError(f"parallelize: module '{name}' is a {type(module).__name__}; style '{style}' "
                        "needs an nn.Linear or a GPT-2 Conv1D")


@dataclass(frozen=True)
class Column:
    """Split output features. ``parts``: fused projection (int = equal parts, or part sizes)."""

    gather_output: bool = False
    parts: Union[None, int, Tuple[int, ...]] = None
    sequence_parallel: bool = False

    def build(self, module: nn.Module, name: str, tp: TPGroup) -> nn.Module:
        _check_linear_like(module, name, "column")
        opts: Dict[str, Any] = dict(sequence_parallel=self.sequence_parallel)
        if self.parts is not None:
            if self.gather_output:
                raise ValueError("Column(parts=..., gather_output=True): gathering a fused projection would "
                                 "interleave its parts' shards ([q_0 k_0 v_0 q_1 ...]); keep the output sharded")
            out_features = module.nf if is_conv1d(module) else module.out_features
            opts["parts"] = _part_sizes(self.parts, out_features, "Column")
            cls = FusedColumnParallelConv1D if is_conv1d(module) else FusedColumnParallelLinear
        else:
            opts["gather_output"] = self.gather_output
            cls = ColumnParallelConv1D if is_conv1d(module) else ColumnParallelLinear
        return cls.from_conv1d(module, group=tp, **opts) if is_conv1d(module) else cls.from_dense(module, group=tp, **opts)


@dataclass(frozen=True)
class KVColumn:
    """A K or V projection of grouped-query attention: split by KV heads when they divide the TP
    degree, else each KV head is held by ``p / num_kv_heads`` consecutive ranks (replicas whose
    gradients are summed), so every rank keeps the KV head its query heads use. ``kv_heads``
    is read from the parent module (the attention) by this dotted path."""

    kv_heads: str = "config.num_key_value_heads"

    def build(self, module: nn.Module, name: str, tp: TPGroup, parent: Optional[nn.Module] = None) -> nn.Module:
        _check_linear_like(module, name, "kv_column")
        if is_conv1d(module):
            raise TypeError(f"parallelize: module '{name}': style 'kv_column' needs an nn.Linear")
        n = _getattr_path(parent, self.kv_heads)
        if n % tp.size == 0:
            return ColumnParallelLinear.from_dense(module, group=tp)
        if tp.size % n:
            raise ValueError(f"{self.kv_heads}={n} neither divides nor is divisible by the TP degree {tp.size}")
        return FusedColumnParallelLinear.from_dense(module, group=tp, parts=[module.out_features], part_shards=[n])


@dataclass(frozen=True)
class Row:
    """Split input features; the input arrives sharded (``input_is_parallel``) or full."""

    input_is_parallel: bool = True
    sequence_parallel: bool = False

    def build(self, module: nn.Module, name: str, tp: TPGroup) -> nn.Module:
        _check_linear_like(module, name, "row")
        opts = dict(input_is_parallel=self.input_is_parallel, sequence_parallel=self.sequence_parallel)
        if is_conv1d(module):
            return RowParallelConv1D.from_conv1d(module, group=tp, **opts)
        return RowParallelLinear.from_dense(module, group=tp, **opts)


@dataclass(frozen=True)
class VocabEmbedding:
    """Split an ``nn.Embedding``'s rows (the vocabulary, padded to the TP degree) across ranks."""

    sequence_parallel: bool = False

    def build(self, module: nn.Module, name: str, tp: TPGroup) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"parallelize: module '{name}' is a {type(module).__name__}; style "
                            "'vocab_embedding' needs an nn.Embedding")
        return VocabParallelEmbedding.from_dense(module, group=tp,
                                                                    sequence_parallel=self.sequence_parallel)


@dataclass(frozen=True)
class VocabHead:
    """An LM head ``nn.Linear(dim, vocab, bias=False)`` split along the (padded) vocabulary.

    ``gather_output=True`` (default) returns full logits, so a model computing its own loss keeps
    working; False keeps this rank's shard for ``vocab_parallel_cross_entropy``. Same layout as
    :class:`VocabEmbedding`, so a head tied to the embedding stays tied.
    """

    gather_output: bool = True

    def build(self, module: nn.Module, name: str, tp: TPGroup) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"parallelize: module '{name}' is a {type(module).__name__}; style "
                            "'vocab_head' needs an nn.Linear")
        return ParallelLMHead.from_dense(module, group=tp, gather_output=self.gather_output)


@dataclass(frozen=True)
class Replicate:
    """Keep the module as it is on every rank."""

    def build(self, module: nn.Module, name: str, tp: TPGroup) -> nn.Module:
        return module


class _InPlace:
    """A style that keeps the module and attaches hooks (applied only after every check passed).

    ``style_name`` marks the module (``_tplayers_styles``) so a second parallelize is refused in
    the check phase instead of stacking a second set of hooks."""

    style_name = ""

    def build(self, module: nn.Module, name: str, tp: TPGroup) -> nn.Module:
        return module

    def check(self, module: nn.Module, name: str) -> None:
        if self.style_name in getattr(module, "_tplayers_styles", ()):
            raise ValueError(f"parallelize: module '{name}' already has the {self.style_name} hooks of an "
                             "earlier parallelize call")

    def apply(self, module: nn.Module, name: str, tp: TPGroup) -> None:
        module._tplayers_styles = getattr(module, "_tplayers_styles", ()) + (self.style_name,)
        if tp.size > 1:
            self._attach(module, tp)

    def _attach(self, module: nn.Module, tp: TPGroup) -> None:
        raise NotImplementedError


def _map_first_input(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor],
                     key: str = "hidden_states") -> None:
    """A forward pre-hook replacing the module's first input (positional or ``key=``) by ``fn`` of it."""

    def pre_hook(m: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        if args:
            return (fn(args[0]),) + tuple(args[1:]), kwargs
        if key in kwargs:
            return args, {**kwargs, key: fn(kwargs[key])}
        raise TypeError(f"parallelize: expected the module's input as the first argument or '{key}='")

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)


@dataclass(frozen=True)
class SequenceParallelNorm(_InPlace):
    """A norm (or any replicated module) inside a sequence-parallel region: it runs on this rank's
    sequence chunk, so its parameter gradients are partial sums, all-reduced over the TP group
    in backward. ``gather_output=True`` also all-gathers its output along the sequence (the
    last norm, before a head that takes the full sequence)."""

    gather_output: bool = False
    style_name = "sequence_parallel_norm"

    def _attach(self, module: nn.Module, tp: TPGroup) -> None:
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(lambda grad, tp=tp: all_reduce_tensor(grad, group=tp))
        if self.gather_output:
            # the head after it all-reduces its input gradient, so the gradient here is complete: split it
            module.register_forward_hook(lambda m, args, out, tp=tp: gather_from_sequence(out, group=tp,
                                                                                        grad_is_partial=False))


@dataclass(frozen=True)
class GatherSequence(_InPlace):
    """Leave the sequence-parallel region for one module whose code needs the whole sequence
    (HF Llama attention reshapes with its input's shape): its first input (``hidden_states``) is
    all-gathered along the sequence. Its TP layers inside are plain (non-sequence-parallel)
    column layers, whose backward all-reduces the input gradient, so this one splits it."""

    style_name = "gather_sequence"

    def _attach(self, module: nn.Module, tp: TPGroup) -> None:
        _map_first_input(module, lambda x: gather_from_sequence(x, group=tp, grad_is_partial=False))


@dataclass(frozen=True)
class ScatterSequence(_InPlace):
    """Enter the sequence-parallel region: the module's first input (``hidden_states``) is cut to
    this rank's sequence chunk (``(b, s, h) -> (b, s/p, h)``); its gradient is all-gathered."""

    style_name = "scatter_sequence"

    def _attach(self, module: nn.Module, tp: TPGroup) -> None:
        _map_first_input(module, lambda x: scatter_to_sequence(x, group=tp))


Style = Union[Column, KVColumn, Row, VocabEmbedding, VocabHead, Replicate, SequenceParallelNorm, ScatterSequence, GatherSequence]

_STYLE_NAMES: Dict[str, Style] = {
    "column": Column(),
    "column_gather": Column(gather_output=True),
    "fused_qkv": Column(parts=3),
    "row": Row(),
    "kv_column": KVColumn(),
    "vocab_embedding": VocabEmbedding(),
    "vocab_head": VocabHead(),
    "replicate": Replicate(),
    "sequence_parallel_norm": SequenceParallelNorm(),
    "scatter_sequence": ScatterSequence(),
    "gather_sequence": GatherSequence(),
}


def _style(value: Union[str, Style], pattern: str) -> Style:
    if isinstance(value, str):
        if value not in _STYLE_NAMES:
            raise ValueError(f"parallelize: unknown style '{value}' for pattern '{pattern}'; "
                             f"known: {sorted(_STYLE_NAMES)} or a Column/Row/VocabEmbedding/VocabHead/Replicate object")
        return _STYLE_NAMES[value]
    if not hasattr(value, "build"):
        raise TypeError(f"parallelize: style for pattern '{pattern}' must be a name or a style object, got {value!r}")
    return value


# ---------------------------------------------------------------------------- plans


@dataclass
class Plan:
    """Module-name patterns -> styles, plus the attributes that must follow the local head count.

    ``divide_attrs``: pattern -> attribute names on the matched modules to divide by the TP
    degree (``num_heads``, ``split_size``); a trailing ``?`` makes an attribute optional (absent
    in some library versions). ``require_divisible``: pattern -> dotted attribute paths (e.g.
    ``config.num_key_value_heads``) that must divide by the TP degree but are left unchanged.
    """

    layers: Dict[str, Union[str, Style]]
    divide_attrs: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    require_divisible: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    name: str = "custom"
    # pattern -> fn(module, tp_size) -> {attr: new value}: attributes a plain division cannot express
    set_attrs: Dict[str, Callable[[nn.Module, int], Dict[str, Any]]] = field(default_factory=dict)


def _llama_local_kv_groups(attn: nn.Module, tp_size: int) -> Dict[str, Any]:
    """Query heads per KV head on one rank: unchanged when KV heads split evenly, else each rank
    holds one KV head (replicated) for its ``num_heads / p`` query heads."""
    heads, kv = attn.config.num_attention_heads, attn.config.num_key_value_heads
    if not hasattr(attn, "num_key_value_groups") or kv % tp_size == 0:
        return {}
    return {"num_key_value_groups": heads // tp_size}


LLAMA_PLAN = Plan(
    name="llama",
    layers={
        "*embed_tokens": "vocab_embedding",
        "*layers.*.self_attn.q_proj": "column",
        "*layers.*.self_attn.k_proj": "kv_column",
        "*layers.*.self_attn.v_proj": "kv_column",
        "*layers.*.self_attn.o_proj": "row",
        "*layers.*.mlp.gate_proj": "column",
        "*layers.*.mlp.up_proj": "column",
        "*layers.*.mlp.down_proj": "row",
        "lm_head": "vocab_head",
    },
    # transformers >= 4.48 reshapes with view(..., -1, head_dim); older versions read these.
    divide_attrs={"*layers.*.self_attn": ("num_heads?", "num_key_value_heads?", "hidden_size?")},
    require_divisible={"*layers.*.self_attn": ("config.num_attention_heads",)},
    set_attrs={"*layers.*.self_attn": _llama_local_kv_groups},
)

GPT2_PLAN = Plan(
    name="gpt2",
    layers={
        "*wte": "vocab_embedding",
        "*h.*.attn.c_attn": "fused_qkv",
        "*h.*.attn.c_proj": "row",
        "*h.*.mlp.c_fc": "column",
        "*h.*.mlp.c_proj": "row",
        "lm_head": "vocab_head",
    },
    divide_attrs={"*h.*.attn": ("num_heads", "split_size", "embed_dim")},
)

def _sequence_parallel(plan: Plan, first_block: Sequence[str], norms: Sequence[str], final_norm: Sequence[str],
                       gather_inputs: Sequence[str] = (), keep: Sequence[str] = ()) -> Plan:
    """The same plan with the residual stream split along the sequence between the TP layers.

    ``gather_inputs``: modules that get the full sequence (their column layers, named in
    ``keep``, stay non-sequence-parallel)."""
    layers: Dict[str, Union[str, Style]] = {}
    for pat, style in plan.layers.items():
        st = _style(style, pat)
        if pat not in keep:
            if isinstance(st, Column) and not st.gather_output:
                st = Column(parts=st.parts, sequence_parallel=True)
            elif isinstance(st, Row):
                st = Row(input_is_parallel=st.input_is_parallel, sequence_parallel=True)
        layers[pat] = st
    for pat in first_block:
        layers[pat] = ScatterSequence()
    for pat in norms:
        layers[pat] = SequenceParallelNorm()
    for pat in final_norm:
        layers[pat] = SequenceParallelNorm(gather_output=True)
    for pat in gather_inputs:
        layers[pat] = GatherSequence()
    return Plan(layers=layers, divide_attrs=dict(plan.divide_attrs), require_divisible=dict(plan.require_divisible),
                name=plan.name + "+sp", set_attrs=dict(plan.set_attrs))


PLANS: Dict[str, Plan] = {"llama": LLAMA_PLAN, "gpt2": GPT2_PLAN}

# Sequence parallelism (Korthikanti et al.): norms and residual adds run on s/p tokens per rank.
SP_PLANS: Dict[str, Plan] = {
    # HF Llama attention views q/k/v with its input's (b, s) shape, so it takes the gathered
    # sequence (plain column q/k/v); o_proj reduce-scatters back into the split residual stream.
    "llama": _sequence_parallel(LLAMA_PLAN, ["layers.0", "model.layers.0"],
                                ["*layers.*.input_layernorm", "*layers.*.post_attention_layernorm"], ["norm", "model.norm"],
                                gather_inputs=["*layers.*.self_attn"],
                                keep=["*layers.*.self_attn.q_proj", "*layers.*.self_attn.k_proj",
                                      "*layers.*.self_attn.v_proj"]),
    "gpt2": _sequence_parallel(GPT2_PLAN, ["h.0", "transformer.h.0"], ["*h.*.ln_1", "*h.*.ln_2"],
                               ["ln_f", "transformer.ln_f"]),
}


def get_plan(plan: Union[str, Plan, Mapping[str, Union[str, Style]]], *, sequence_parallel: bool = False) -> Plan:
    """A :class:`Plan` from a shipped plan's name, a Plan, or a ``{pattern: style}`` dict."""
    if sequence_parallel and not isinstance(plan, str):
        raise ValueError("parallelize: sequence_parallel=True selects a shipped plan's sequence-parallel variant; "
                         "in your own plan use Column/Row(sequence_parallel=True), 'scatter_sequence' and "
                         "'sequence_parallel_norm' styles")
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str):
        if plan not in PLANS:
            raise ValueError(f"parallelize: unknown plan '{plan}'; shipped plans: {sorted(PLANS)}")
        return SP_PLANS[plan] if sequence_parallel else PLANS[plan]
    if isinstance(plan, Mapping):
        return Plan(layers=dict(plan))
    raise TypeError(f"parallelize: plan must be a plan name, a Plan or a dict, got {type(plan).__name__}")


def _getattr_path(obj: Any, path: str) -> Any:
    value = obj
    for part in path.split("."):
        if not hasattr(value, part):
            raise AttributeError(f"{type(obj).__name__} has no attribute path '{path}' (no '{part}')")
        value = getattr(value, part)
    return value


def _match(name: str, patterns: Sequence[str]) -> Optional[str]:
    for p in patterns:
        if fnmatch.fnmatchcase(name, p):
            return p
    return None


def parallelize(model: nn.Module, plan: Union[str, Plan, Mapping[str, Union[str, Style]]], *,
                group: GroupLike, sequence_parallel: bool = False) -> nn.Module:
    """Swap, in place, the modules ``plan`` names for TP layers holding this rank's shard.

    Every rank of ``group`` calls it on an identical dense model (same weights). Returns
    ``model``. All checks (module types, divisibility, head counts, tied weights) run before any
    module is swapped; errors name the module. Tied parameters (GPT-2's ``lm_head.weight`` and
    ``wte.weight``) stay tied when both modules are swapped with the same layout.
    ``sequence_parallel=True`` (shipped plans): activations between the TP layers are split along
    the sequence (its length must divide by the TP degree).
    """
    tp = resolve_group(group)
    p = get_plan(plan, sequence_parallel=sequence_parallel)
    styles = {pat: _style(v, pat) for pat, v in p.layers.items()}
    modules = dict(model.named_modules())

    # 1. build every TP module (nothing swapped yet, so an error leaves the model untouched)
    built: Dict[str, nn.Module] = {}
    in_place: List[Tuple[_InPlace, nn.Module, str]] = []
    matched = set()
    for name, module in modules.items():
        pat = _match(name, list(styles))
        if pat is not None:
            matched.add(pat)
        if pat is None or isinstance(styles[pat], Replicate):
            continue
        if name == "":
            raise ValueError(f"parallelize: pattern '{pat}' matches the root module; name a submodule")
        if any(name.startswith(other + ".") for other in built):
            continue  # inside a module already swapped
        if isinstance(styles[pat], _InPlace):
            styles[pat].check(module, name)
            in_place.append((styles[pat], module, name))
            continue
        if isinstance(module, TensorParallelModule):
            raise ValueError(f"parallelize: module '{name}' is already tensor-parallel "
                             f"({type(module).__name__}); parallelize each model once")
        try:
            style = styles[pat]
            if isinstance(style, KVColumn):
                parent_name = name.rpartition(".")[0]
                built[name] = style.build(module, name, tp, parent=modules[parent_name])
            else:
                built[name] = style.build(module, name, tp)
        except (ValueError, TypeError, AttributeError) as e:
            msg = str(e)
            raise type(e)(msg if msg.startswith("parallelize:") else f"parallelize: module '{name}' ({pat!r}): {msg}") from None
    enters = [n for st, _, n in in_place if isinstance(st, ScatterSequence)]
    leaves = [n for st, _, n in in_place if isinstance(st, SequenceParallelNorm) and st.gather_output]
    if bool(enters) != bool(leaves):
        raise ValueError(f"parallelize: plan '{p.name}' enters sequence parallelism at {enters} but leaves it at "
                         f"{leaves}: it needs both a 'scatter_sequence' module and a gathering final norm")
    if not built and not in_place:
        raise ValueError(f"parallelize: plan '{p.name}' matched no module of {type(model).__name__} "
                         f"(patterns {list(styles)}); module names look like {list(modules)[1:6]}")
    unmatched = [pat for pat in styles if pat not in matched]
    if unmatched and not isinstance(plan, str):  # shipped plans list alternatives (with/without a head, prefix)
        warnings.warn(f"parallelize: plan pattern(s) {unmatched} matched no module of {type(model).__name__} "
                      "(or only modules an earlier pattern took); those modules stay as they are", stacklevel=2)

    # 2. attributes that follow the local head count: check all, then change
    changes: List[Tuple[nn.Module, str, int]] = []
    for name, module in modules.items():
        for pat, paths in p.require_divisible.items():
            if fnmatch.fnmatchcase(name, pat):
                for path in paths:
                    try:
                        value = _getattr_path(module, path)
                    except AttributeError as e:
                        raise AttributeError(f"parallelize: module '{name}' ({pat!r}): {e}") from None
                    if value % tp.size:
                        raise ValueError(f"parallelize: module '{name}': {path}={value} is not divisible by the "
                                         f"TP degree {tp.size}")
        for pat, fn in p.set_attrs.items():
            if fnmatch.fnmatchcase(name, pat):
                changes.extend((module, attr, value) for attr, value in fn(module, tp.size).items())
        for pat, attrs in p.divide_attrs.items():
            if not fnmatch.fnmatchcase(name, pat):
                continue
            for attr in attrs:
                optional = attr.endswith("?")
                attr = attr.rstrip("?")
                if not hasattr(module, attr):
                    if optional:
                        continue
                    raise AttributeError(f"parallelize: module '{name}' ({type(module).__name__}) has no attribute "
                                         f"'{attr}' that plan '{p.name}' divides by the TP degree")
                value = getattr(module, attr)
                if not isinstance(value, int) or value % tp.size:
                    raise ValueError(f"parallelize: module '{name}': {attr}={value} is not divisible by the "
                                     f"TP degree {tp.size}")
                changes.append((module, attr, value // tp.size))

    # 3. tied parameters: both sides swapped with the same layout, or an error
    ties = _tied_groups(model)
    retie: List[Tuple[nn.Module, str, nn.Module, str]] = []
    for group_names in ties:
        owners = [(n.rpartition(".")[0], n.rpartition(".")[2]) for n in group_names]
        swapped = [o for o in owners if o[0] in built]
        if not swapped:
            continue
        if len(swapped) != len(owners):
            raise ValueError(f"parallelize: parameters {group_names} are tied (one tensor) but the plan swaps only "
                             f"{[m + '.' + a for m, a in swapped]}: swap all of them or none")
        (m0, a0), rest = owners[0], owners[1:]
        l0 = _layout_of(built[m0], a0)
        for m, a in rest:
            if _layout_of(built[m], a) != l0 or getattr(built[m], a).shape != getattr(built[m0], a0).shape:
                raise ValueError(f"parallelize: tied parameters '{m0}.{a0}' and '{m}.{a}' get different TP layouts "
                                 f"({l0} vs {_layout_of(built[m], a)}); they cannot stay tied")
            retie.append((built[m], a, built[m0], a0))

    # 4. swap
    for name, new in built.items():
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)
    for module, attr, value in changes:
        setattr(module, attr, value)
    for dst, a, src, a0 in retie:
        setattr(dst, a, getattr(src, a0))
    for style, module, name in in_place:
        style.apply(module, name, tp)
    return model


def _layout_of(module: nn.Module, pname: str) -> Optional[Placement]:
    if isinstance(module, TensorParallelModule):
        return module.param_placements().get(pname)
    return None


def _tied_groups(model: nn.Module) -> List[List[str]]:
    by_id: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]
