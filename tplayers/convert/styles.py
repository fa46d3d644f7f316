"""Parallel styles: what ``parallelize`` does to one module a plan names. One contract for all.

Every style is an object with ``build(module, ctx) -> Built``. ``build`` only checks and prepares
(it may construct the TP replacement, which reads but never changes the dense module); nothing in
the model changes until every style of the plan has built. Then the engine puts each
``Built.module`` in place of the original (when it differs) and calls each ``Built.finish`` (hooks
on modules that stay). So an error anywhere leaves the model untouched, and the engine never needs
to know which style it is running. Styles that convert a whole module of a family's own class (MoE experts,
multi-head latent attention's KV projection, Mamba mixers): :mod:`tplayers.convert.styles_whole`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import torch.nn as nn

from ..core.groups import TPGroup
from ..regions.partial_grads import PartialGradSum
from ..core.siblings import ColumnInputs
from ..core.placement import Part, Sharded, kv_shards, require_divisible
from ..core.head_layout import head_parts, kv_part, qkv_placement
from ..layers.base import class_name
from ..layers.conv1d import ColumnParallelConv1D, FusedColumnParallelConv1D, RowParallelConv1D, is_conv1d
from ..layers.fused import FusedColumnParallelLinear
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..layers.from_dense import computes_linear, own_forward
from ..layers.lora import is_peft_lora, prepare_lora
from .heads import head_counts, attention_heads, getattr_path

__all__ = ["BuildContext", "Built", "SequenceSwitch", "Style", "Column", "FusedQKV", "KVColumn", "Row",
           "Replicate"]


class SequenceSwitch:
    """Whether sequence parallelism is on for the current forward, shared by every sequence-parallel
    layer and hook of one ``parallelize`` call. The hook entering the region sets it each forward
    (:class:`~tplayers.convert.sequence.ScatterSequence`): off when the sequence length does not
    divide the TP degree and no gradient is recorded (a decoding step of ``generate``)."""

    def __init__(self) -> None:
        self.layers: List[nn.Module] = []  # the sequence-parallel TP layers
        self.active = True

    def set(self, active: bool) -> None:
        self.active = active
        for layer in self.layers:
            layer.sequence_parallel = active


@dataclass(frozen=True)
class BuildContext:
    """Where a style is applied: the module's qualified name, its parent, the TP group, and the
    sequence-parallel switch and the replicated parameters with partial gradients of this ``parallelize``
    call."""

    name: str
    group: TPGroup
    parent: Optional[nn.Module] = None
    switch: SequenceSwitch = field(default_factory=SequenceSwitch)
    partial_grads: Optional[PartialGradSum] = None  # the call's replicated parameters with partial gradients
    replica_sums: Dict[Any, PartialGradSum] = field(default_factory=dict)  # (attention, holders) -> its k and v
    column_inputs: ColumnInputs = field(default_factory=ColumnInputs)  # the model's siblings' calls, gathers offered
    tp_invariant: bool = False  # parallelize(..., tp_invariant=True): partial gradients summed as the fixed tree


@dataclass
class Built:
    """What a style made of a module: its replacement (the module itself if it stays) and, for a
    module that stays, what to do to it once every check of the plan has passed."""

    module: nn.Module
    finish: Optional[Callable[[], None]] = None
    region: Optional[str] = None  # "enter_sequence" / "leave_sequence": where a sequence-parallel region starts, ends
    label: Optional[str] = None  # what the module became, for the coverage report, when it stays in place


@runtime_checkable
class Style(Protocol):
    """``build(module, ctx) -> Built``: check ``module`` and return its replacement, or the module
    itself with a ``finish`` to run once the whole plan has built. It must not change the model."""

    def build(self, module: nn.Module, ctx: BuildContext) -> Built: ...


def refuse_own_forward(module: nn.Module, base: type, ctx: BuildContext, style: str) -> None:
    """A subclass of ``base`` whose ``forward`` is its own (a LoRA or quantized linear) would silently
    lose that behaviour when swapped for a plain TP layer: refuse it."""
    override = own_forward(module, base)
    if override is not None and not (base is nn.Linear and computes_linear(module)):
        raise TypeError(f"parallelize: module '{ctx.name}' is a {class_name(module)}, a subclass of "
                        f"nn.{base.__name__} "
                        f"whose forward ({override}.forward) differs from it; style '{style}' would swap it for a "
                        "plain TP layer and drop that behaviour. Give it a style that knows it, or leave it out of "
                        "the plan ('replicate')")


def _check_linear_like(module: nn.Module, ctx: BuildContext, style: str) -> None:
    if is_conv1d(module):
        return
    if not isinstance(module, nn.Linear):
        raise TypeError(f"parallelize: module '{ctx.name}' is a {class_name(module)}; style '{style}' "
                        "needs an nn.Linear, a GPT-2 Conv1D, or a module that holds only a weight (out, in) and a bias "
                        "and computes F.linear(x, weight, bias) with them (probed)")
    refuse_own_forward(module, nn.Linear, ctx, style)


def _from(module: nn.Module, linear_cls: type, conv_cls: type, ctx: BuildContext, **options: Any) -> nn.Module:
    """The TP layer of ``module`` (an nn.Linear, or a Conv1D through its Conv1D twin class)."""
    if is_conv1d(module):
        return conv_cls.from_conv1d(module, group=ctx.group, **options)
    return linear_cls.from_dense(module, group=ctx.group, **options)


def _with_lora(style: Style, module: nn.Module, ctx: BuildContext, kind: str) -> Built:
    """A PEFT LoRA layer: its ``base_layer`` built by ``style``, the adapter split to match
    (:mod:`tplayers.layers.lora`); the PEFT module stays in place."""
    # the wrapper is transparent: the base layer's parent is the module's (KVColumn reads the attention's heads)
    base = style.build(module.base_layer, replace(ctx, name=f"{ctx.name}.base_layer"))
    install = prepare_lora(module, base.module, kind, ctx.name)

    def finish() -> None:
        install()
        if base.finish is not None:
            base.finish()
    return Built(module, finish=finish, label=f"PEFT LoRA over {type(base.module).__name__}")


def is_peft_saved_copies(module: nn.Module) -> bool:
    """PEFT's ``ModulesToSaveWrapper`` (``modules_to_save=["embed_tokens", "lm_head"]``): the frozen
    ``original_module`` and a trainable copy per adapter in ``modules_to_save``."""
    return (type(module).__module__.startswith("peft.") and isinstance(getattr(module, "original_module", None), nn.Module)
            and isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict))


def with_saved_copies(style: Style, module: nn.Module, ctx: BuildContext) -> Built:
    """A PEFT ``modules_to_save`` wrapper: its original module and every adapter's copy built by ``style``
    (the copies train; each is split like the module it copies); the wrapper stays in place."""
    inner = [("original_module", module.original_module)] + [(f"modules_to_save.{a}", m)
                                                             for a, m in module.modules_to_save.items()]
    built = [(path, style.build(m, replace(ctx, name=f"{ctx.name}.{path}")))
             for path, m in inner]

    def finish() -> None:
        for path, b in built:
            if path == "original_module":
                module.original_module = b.module
            else:
                module.modules_to_save[path.split(".", 1)[1]] = b.module
            if b.finish is not None:
                b.finish()
    return Built(module, finish=finish, label=f"PEFT modules_to_save over {type(built[0][1].module).__name__}")


def switched(layer: nn.Module, ctx: BuildContext) -> Built:
    """A sequence-parallel layer follows its call's :class:`SequenceSwitch` (registered once swapped in)."""
    if not getattr(layer, "sequence_parallel", False):
        return Built(layer)
    return Built(layer, finish=lambda: ctx.switch.layers.append(layer))


def _part_sizes(parts: Union[int, Sequence[int]], out_features: int) -> Tuple[int, ...]:
    if isinstance(parts, int):
        if parts < 1 or out_features % parts:
            raise ValueError(f"Column: out_features={out_features} does not split into {parts} equal parts")
        return (out_features // parts,) * parts
    sizes = tuple(int(s) for s in parts)
    if sum(sizes) != out_features:
        raise ValueError(f"Column: part sizes {sizes} sum to {sum(sizes)}, out_features={out_features}")
    return sizes


def _feature_split(size: int, ctx: BuildContext, uneven: bool) -> Optional[Part]:
    """How a plain column / row split cuts ``size`` features: None (evenly; the layer refuses sizes that do
    not divide) unless ``uneven`` and they do not divide: then as evenly as possible (an uneven part; the
    row-parallel layer masks the padding)."""
    if size % ctx.group.size == 0 or not uneven:
        return None
    return Sharded.balanced(0, size, ctx.group.size).parts[0]


def _heads_split(features: int, ctx: BuildContext, style: str) -> Optional[Part]:
    """The query heads' part of ``features`` (q_proj's output, o_proj's input) by the attention's head
    counts (:func:`~tplayers.core.head_layout.head_parts`); None when it is an even split."""
    try:
        heads, kv = attention_heads(ctx.parent)
    except AttributeError as e:
        raise AttributeError(f"{e}: {style}(heads=True) reads the head counts from the attention holding "
                             f"'{ctx.name}'") from None
    if heads is None or features % heads:
        raise ValueError(f"{style}(heads=True): '{ctx.name}' has {features} features, not whole heads of the "
                         f"attention's {heads} heads")
    q, _ = head_parts(heads, kv, features // heads, ctx.group.size, f"parallelize: module '{ctx.name}'")
    return q if q.is_uneven else None


def _refuse_uneven_conv1d(module: nn.Module, ctx: BuildContext, what: str) -> None:
    """GPT-2's Conv1D twins split evenly only: refuse an uneven cut of ``what`` on one."""
    if is_conv1d(module):
        raise ValueError(f"parallelize: module '{ctx.name}' is a Conv1D whose {what} do not divide the TP degree "
                         f"{ctx.group.size}; uneven splits are supported on nn.Linear only")


def _with_split(layer_cls: type, conv_cls: type, module: nn.Module, ctx: BuildContext, split: Optional[Part],
                **options: Any) -> nn.Module:
    """``_from`` with an uneven ``split`` passed on (nn.Linear only)."""
    if split is None:
        return _from(module, layer_cls, conv_cls, ctx, **options)
    _refuse_uneven_conv1d(module, ctx, f"{split.size} features")
    return layer_cls.from_dense(module, group=ctx.group, split=split, **options)


@dataclass(frozen=True)
class Column:
    """Split output features. ``parts``: fused projection (int = equal parts, or part sizes).
    ``heads``: the output is the query heads of the attention holding the layer (q_proj), cut by whole
    heads (:func:`~tplayers.core.head_layout.head_parts`), as evenly as possible when they do not divide the
    TP degree. ``uneven``: features (of each part) that do not divide the TP degree are split as evenly as
    possible instead of refused; the layer consuming them must be a ``Row(uneven=True)`` of the same size
    (an MLP's ffn). Opt-in: an output cut anywhere would split a head that the plan does not know of."""

    gather_output: bool = False
    parts: Union[None, int, Tuple[int, ...]] = None
    sequence_parallel: bool = False
    heads: bool = False
    uneven: bool = False

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        if is_peft_lora(module):
            return _with_lora(self, module, ctx, "column")
        if is_peft_saved_copies(module):
            return with_saved_copies(self, module, ctx)
        _check_linear_like(module, ctx, "column")
        out = module.nf if is_conv1d(module) else module.out_features
        if self.parts is None:
            split = _heads_split(out, ctx, "Column") if self.heads else _feature_split(out, ctx, self.uneven)
            return switched(_with_split(ColumnParallelLinear, ColumnParallelConv1D, module, ctx, split,
                                         gather_output=self.gather_output, sequence_parallel=self.sequence_parallel),
                             ctx)
        if self.gather_output:
            raise ValueError("Column(parts=..., gather_output=True): gathering a fused projection would "
                             "interleave its parts' shards ([q_0 k_0 v_0 q_1 ...]); keep the output sharded")
        if self.heads:
            raise ValueError("Column(parts=..., heads=True): a fused projection with heads is FusedQKV's")
        parts: List[Any] = list(_part_sizes(self.parts, out))
        if self.uneven and any(n % ctx.group.size for n in parts):  # each component as evenly as possible
            _refuse_uneven_conv1d(module, ctx, f"parts {self.parts}")
            parts = [Sharded.balanced(0, n, ctx.group.size).parts[0] for n in parts]
        return switched(_from(module, FusedColumnParallelLinear, FusedColumnParallelConv1D, ctx, parts=parts,
                               sequence_parallel=self.sequence_parallel), ctx)


def read_count(value: Union[int, str], ctx: BuildContext, style: str, what: str) -> int:
    """A head count given as a number or as a dotted attribute path on the parent module (the attention)."""
    if isinstance(value, int):
        return value
    try:
        count = getattr_path(ctx.parent, value)
    except AttributeError as e:
        raise AttributeError(f"{e}: {style} reads {what} from the attention holding '{ctx.name}'; give the count "
                             f"itself ({style}({what}=8)) or the attribute your attention keeps it in "
                             f"({style}({what}='n_kv_heads'))") from None
    if not isinstance(count, int):
        raise TypeError(f"{style}: {what} '{value}' on '{ctx.name}''s parent is {count!r}, not an int")
    return count


@dataclass(frozen=True)
class FusedQKV:
    """A fused ``[q; k; v]`` projection split by heads: q's ``heads`` and k's and v's ``kv_heads`` (None:
    as many as ``heads``), each a number or an attribute path on the attention (``"n_head"``). Each
    rank gets whole heads of each component; a head count that does not divide the TP degree is
    refused (never a head cut in two), and KV heads fewer than ranks are replicated (the KV-head rule).
    The bare name "fused_qkv" splits the three thirds without knowing the heads."""

    heads: Union[int, str]
    kv_heads: Union[None, int, str] = None

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        if is_peft_lora(module):
            return _with_lora(self, module, ctx, "column")
        _check_linear_like(module, ctx, "FusedQKV")
        heads = read_count(self.heads, ctx, "FusedQKV", "heads")
        kv = heads if self.kv_heads is None else read_count(self.kv_heads, ctx, "FusedQKV", "kv_heads")
        out = module.nf if is_conv1d(module) else module.out_features
        layer = f"parallelize: module '{ctx.name}' (FusedQKV)"
        if heads < 1 or kv < 1 or out % (heads + 2 * kv):
            raise ValueError(f"{layer}: out_features={out} is not (heads + 2 * kv_heads) * head_dim for heads={heads}, "
                             f"kv_heads={kv}")
        # heads that do not divide the TP degree stay refused here: the plan's output projection (a plain
        # Row) and the attention's own head attributes would not follow an uneven cut
        why = ("; FusedQKV splits whole heads evenly only (the output projection and the attention's head "
               "attributes of a plan follow an even cut); separate q/k/v projections split unevenly: "
               "Column(heads=True), KVColumn(uneven=True), Row(heads=True)")
        try:
            require_divisible(heads, ctx.group.size, layer, "num_heads")
            kv_shards(kv, ctx.group.size, layer, "num_kv_heads")
        except ValueError as e:
            raise ValueError(f"{e}{why}") from None
        placement = qkv_placement(heads, kv, out // (heads + 2 * kv), ctx.group.size, layer=layer)
        options = dict(parts=[part.size for part in placement.parts],
                       part_shards=[part.shards for part in placement.parts])
        if is_conv1d(module):
            return Built(FusedColumnParallelConv1D.from_conv1d(module, group=ctx.group, **options))
        return Built(FusedColumnParallelLinear.from_dense(module, group=ctx.group, **options))


SPLIT_BY_KV_HEADS = "_tplayers_split_by_kv_heads"  # on a column layer KVColumn built (the audit's causes read it)


@dataclass(frozen=True)
class KVColumn:
    """A K or V projection of grouped-query attention, cut by the KV-head rule
    (:func:`~tplayers.core.placement.kv_shards`): split by KV heads when they divide the TP degree,
    else each KV head is held by ``p / num_kv_heads`` consecutive ranks (replicas whose gradients
    are summed). ``kv_heads``: the count, or the dotted attribute path on the parent module (the
    attention) that holds it; None (default): the attention's KV heads as :func:`attention_heads`
    reads them (Hugging Face's ``config.num_key_value_heads``; multi-head attention: its heads).
    ``uneven``: KV heads that do not divide the TP degree (nor divide it) are cut as evenly as possible
    (:func:`~tplayers.core.head_layout.kv_part`) instead of refused; the query projection must then be
    ``Column(heads=True)`` and the output projection ``Row(heads=True)`` (a plain column would not follow)."""

    kv_heads: Union[None, int, str] = None
    uneven: bool = False

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        if is_peft_lora(module):
            return _with_lora(self, module, ctx, "column")
        if not isinstance(module, nn.Linear):
            raise TypeError(f"parallelize: module '{ctx.name}' is a {class_name(module)}; style 'kv_column' "
                            "needs an nn.Linear")
        refuse_own_forward(module, nn.Linear, ctx, "kv_column")
        if self.kv_heads is None:
            try:
                _, count, where = head_counts(ctx.parent)
            except AttributeError as e:
                raise AttributeError(f"{e}: KVColumn reads the KV heads from the attention holding '{ctx.name}'; give "
                                     "the count itself (KVColumn(kv_heads=8)) or the attribute your attention keeps it "
                                     "in (KVColumn(kv_heads='n_kv_heads'))") from None
            where = where or "KV heads (multi-head: its heads)"
        else:
            count, where = read_count(self.kv_heads, ctx, "KVColumn", "kv_heads"), str(self.kv_heads)
        if count < 1 or module.out_features % count:
            raise ValueError(f"kv_column: '{ctx.name}' has out_features={module.out_features}, not whole heads of "
                             f"{where}={count} KV heads")
        if not self.uneven:
            kv_shards(count, ctx.group.size, "kv_column", where)  # refuses what does not split or replicate evenly
        part = kv_part(count, module.out_features // count, ctx.group.size, "kv_column", where)
        if part.shards == ctx.group.size:  # whole KV heads per rank (evenly, or as evenly as possible)
            layer = ColumnParallelLinear.from_dense(module, group=ctx.group, **({"split": part} if part.is_uneven else {}))
            setattr(layer, SPLIT_BY_KV_HEADS, True)
            return Built(layer)
        layer = FusedColumnParallelLinear.from_dense(module, group=ctx.group, parts=[part])
        holders = part.holder_counts(ctx.group.size)
        key = (id(ctx.parent), holders)  # k and v of one attention: their replica sums in one collective

        def finish() -> None:
            layer.replica_sum = ctx.replica_sums.setdefault(key, PartialGradSum(ctx.group, holders))
            layer.replica_sum.register(layer, tuple(n for n, _ in layer.named_parameters(recurse=False)))
        return Built(layer, finish=finish)


@dataclass(frozen=True)
class Row:
    """Split input features; the input arrives sharded (``input_is_parallel``) or full. ``heads``: the
    input is the attention's heads (o_proj), cut as ``Column(heads=True)`` cuts q_proj. ``uneven``: sharded
    input features that do not divide the TP degree are cut as ``Column(uneven=True)`` cuts them."""

    input_is_parallel: bool = True
    sequence_parallel: bool = False
    heads: bool = False
    uneven: bool = False

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        if is_peft_lora(module):
            return _with_lora(self, module, ctx, "row")
        if is_peft_saved_copies(module):
            return with_saved_copies(self, module, ctx)
        _check_linear_like(module, ctx, "row")
        features = module.nx if is_conv1d(module) else module.in_features
        split = None
        if self.input_is_parallel:
            split = _heads_split(features, ctx, "Row") if self.heads else _feature_split(features, ctx, self.uneven)
        return switched(_with_split(RowParallelLinear, RowParallelConv1D, module, ctx, split,
                                     input_is_parallel=self.input_is_parallel, sequence_parallel=self.sequence_parallel),
                         ctx)


@dataclass(frozen=True)
class Replicate:
    """Keep the module as it is on every rank (documents intent; matching it stops later patterns)."""

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        return Built(module)

