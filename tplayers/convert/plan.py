"""Plans as data: module-name patterns -> styles, plus the attributes that follow the local head count.

A pattern is an ``fnmatch`` pattern over qualified module names (``*`` also matches dots); the first
pattern that matches a module decides its style. Styles are given by name (the table below) or as
style objects (:mod:`tplayers.convert.styles`, :mod:`tplayers.convert.sequence`).
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch.nn as nn

from ..core.head_layout import head_parts
from .sequence import GatherSequence, PerHeadParams, ReplicateReduceGrad, ScatterSequence, SequenceParallelNorm
from .heads import attention_heads
from .styles import Column, KVColumn, Replicate, Row, Style
from .styles_vocab import VocabEmbedding, VocabHead
from .styles_whole import MambaMixer

__all__ = ["Plan", "STYLE_NAMES", "local_attention_attrs", "local_head_attrs", "resolve_style", "sequence_parallel_variant"]

#: The style names a plan may use as strings (``{"blocks.*.fc1": "column"}``) -> the style each stands for.
STYLE_NAMES: Dict[str, Style] = {
    "column": Column(),
    "column_gather": Column(gather_output=True),
    "fused_qkv": Column(parts=3),
    "row": Row(),
    "kv_column": KVColumn(),
    "mamba_mixer": MambaMixer(),
    "vocab_embedding": VocabEmbedding(),
    "vocab_head": VocabHead(),
    "replicate": Replicate(),
    "replicate_reduce_grad": ReplicateReduceGrad(),
    "sequence_parallel_norm": SequenceParallelNorm(),
    "scatter_sequence": ScatterSequence(),
    "gather_sequence": GatherSequence(),
}


def resolve_style(value: Union[str, Style], pattern: str) -> Style:
    """The style object a plan entry names, or an error naming the pattern."""
    if isinstance(value, str):
        if value not in STYLE_NAMES:
            raise ValueError(f"parallelize: unknown style '{value}' for pattern '{pattern}'; "
                             f"known: {sorted(STYLE_NAMES)} or a style object with build(module, ctx)")
        return STYLE_NAMES[value]
    if not isinstance(value, Style):
        raise TypeError(f"parallelize: style for pattern '{pattern}' must be a name or a style object, got {value!r}")
    return value


@dataclass
class Plan:
    """Module-name patterns -> styles, plus the attributes that must follow the local head count.

    ``divide_attrs``: pattern -> attribute names on the matched modules to divide by the TP
    degree (``num_heads``, ``split_size``); a trailing ``?`` makes an attribute optional (absent
    in some library versions); a dotted path (``config.n_head``) divides it in a copy, per module,
    of each object on the way (a config object the layers share stays as it was, for the others and
    for the audit's dense twin); ``"cache_k:2"`` cuts a tensor attribute or buffer (a KV cache shaped by the
    heads) along dim 2 to this rank's part. ``require_divisible``: pattern -> dotted attribute paths (e.g.
    ``config.num_key_value_heads``) that must divide by the TP degree but are left unchanged.
    ``set_attrs``: pattern -> ``fn(module, tp_size) -> {attr: value}`` for what a division cannot express.
    """

    layers: Dict[str, Union[str, Style]]
    divide_attrs: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    require_divisible: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    name: str = "custom"
    set_attrs: Dict[str, Callable[[nn.Module, int], Dict[str, Any]]] = field(default_factory=dict)


def _local_head_counts(attn: nn.Module, tp_size: int) -> Optional[Tuple[int, int]]:
    """(query heads, KV heads) in each rank's local tensors (the padded width: :func:`head_parts`), or None
    when the attention keeps no query-head count."""
    heads, kv = attention_heads(attn)
    if heads is None:
        return None
    q, kv_rows = head_parts(heads, kv, 1, tp_size, f"parallelize: {type(attn).__name__}")  # head_dim 1: rows = heads
    return q.local_size, kv_rows.local_size


def local_head_attrs(attn: nn.Module, tp_size: int) -> Dict[str, int]:
    """The head-count attributes a Hugging Face attention keeps, at one rank's heads (a ``set_attrs``
    rule; the one rule for every family): ``num_heads`` / ``num_attention_heads`` = heads / p;
    ``num_key_value_heads`` = KV heads / p, or 1 when there are fewer KV heads than ranks (each rank
    holds one replicated KV head, the KV-head rule of ``KVColumn``); ``num_key_value_groups`` = local
    heads / local KV heads. Heads that do not divide the TP degree count each rank's padded width (the largest rank's heads,
    :func:`~tplayers.core.head_layout.head_parts`), the same on every rank. Heads and KV heads are read by :func:`~tplayers.convert.heads.attention_heads`
    (no KV count: multi-head); attributes the attention does not keep are left out."""
    counts = _local_head_counts(attn, tp_size)
    if counts is None:
        return {}
    local_heads, local_kv = counts
    local = {"num_heads": local_heads, "num_attention_heads": local_heads, "num_key_value_heads": local_kv,
             "num_key_value_groups": local_heads // local_kv}
    return {attr: value for attr, value in local.items()
            if isinstance(getattr(attn, attr, None), int) and not isinstance(getattr(attn, attr), bool)}


def local_attention_attrs(attn: nn.Module, tp_size: int) -> Dict[str, int]:
    """:func:`local_head_attrs`, and ``hidden_size`` (older transformers reshape the
    attention's output by it) at the local heads' width, where the attention keeps it."""
    local = local_head_attrs(attn, tp_size)
    heads, _ = attention_heads(attn)
    hidden = getattr(attn, "hidden_size", None)
    if heads and isinstance(hidden, int) and not isinstance(hidden, bool):
        if hidden % heads == 0:
            local["hidden_size"] = hidden // heads * _local_head_counts(attn, tp_size)[0]
        elif hidden % tp_size == 0:
            local["hidden_size"] = hidden // tp_size
        else:
            raise ValueError(f"parallelize: {type(attn).__name__}.hidden_size={hidden} is neither whole heads of its "
                             f"{heads} heads nor divisible by the TP degree {tp_size}")
    return local


def sequence_parallel_variant(plan: Plan, first_block: Sequence[str], norms: Sequence[str], final_norm: Sequence[str],
                              gather_inputs: Sequence[str] = (), keep: Sequence[str] = ()) -> Plan:
    """The same plan with the residual stream split along the sequence between the TP layers
    (Korthikanti et al.): column/row layers become sequence-parallel, the first block scatters its
    input, ``norms`` run on s/p tokens, ``final_norm`` gathers. ``gather_inputs``: modules that get
    the full sequence (their column layers, named in ``keep``, stay non-sequence-parallel)."""
    layers: Dict[str, Union[str, Style]] = {}
    for pat, value in plan.layers.items():
        style = resolve_style(value, pat)
        if pat not in keep:
            if isinstance(style, Column) and not style.gather_output:
                style = dataclasses.replace(style, sequence_parallel=True)
            elif isinstance(style, Row):
                style = dataclasses.replace(style, sequence_parallel=True)
            elif isinstance(style, VocabEmbedding) and not style.sequence_parallel:
                style = dataclasses.replace(style, partial_output=True)  # the first block reduce-scatters it
        layers[pat] = style
    layers.update({pat: ScatterSequence() for pat in first_block})
    layers.update({pat: SequenceParallelNorm() for pat in norms})
    layers.update({pat: SequenceParallelNorm(gather_output=True) for pat in final_norm})
    for pat in gather_inputs:  # a style the module has already (an attention's per-head sinks) is kept beside it
        had = layers.get(pat)
        if had is not None and not isinstance(had, PerHeadParams):
            raise ValueError(f"sequence parallelism: '{pat}' gathers the sequence for its own code, but the plan already "
                             f"styles it {type(had).__name__}; a module takes one style")
        layers[pat] = GatherSequence(then=had)
    return Plan(layers=layers, divide_attrs=dict(plan.divide_attrs), require_divisible=dict(plan.require_divisible),
                name=plan.name + "+sp", set_attrs=dict(plan.set_attrs))
