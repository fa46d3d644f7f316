"""Sequence-parallel styles: enter the split residual stream, leave it, and run norms inside it.

Under sequence parallelism the activations between the TP layers are ``(b, s/p, h)``. These styles
keep the module and attach forward hooks (in ``Built.finish``, after every check of the plan passed).
A norm inside the region runs on this rank's tokens, so its replicated parameters get partial
gradients: they enter its forward through the call's :class:`~tplayers.regions.partial_grads.PartialGradSum`
(identity forward; backward every norm's gradient summed over the group by one all-reduce), and carry
the placement ``Replicated(partial_grad=True)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

from ..core.comm import gather_sequence_for_columns, scatter_to_sequence
from ..core.invariant import LEAVES
from .gather_dtype import CastGather, SortGather
from .invariant import KV_REPLICAS_REASON, run_in_leaves
from ..regions.partial_grads import PartialGradSum
from ..regions.partial_sum import PartialSum
from ..core.placement import Replicated, Sharded
from ..core.head_layout import head_parts
from ..layers.base import PLACEMENTS_ATTR, route_params_through
from .heads import attention_heads
from .styles import BuildContext, Built, Row

__all__ = ["ScatterSequence", "GatherSequence", "SequenceParallelNorm", "ReplicateReduceGrad", "PerHeadParams",
           "map_first_input",
           "check_sequence_region", "refuse_double_gather", "takes_sequence_shards"]

MARK = "_tplayers_styles"  # the sequence styles already applied to a module (refuse stacking a second set)


OTHER_SHARDS = "_tplayers_other_sequence_shards"  # a gather_sequence module's other inputs shaped like its first


def _like(a: object, first: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point() and a.shape == first.shape


def map_first_input(module: nn.Module, fn: Callable[..., torch.Tensor], key: str = "hidden_states",
                    called: bool = False) -> None:
    """A forward pre-hook replacing the module's first input (positional or ``key=``) by ``fn`` of it (``called``:
    ``fn(x, the module called)``: a deep copy of the module calls the same hook)."""

    def pre_hook(m: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        run = (lambda x: fn(x, m)) if called else fn
        if args:
            return (run(args[0]),) + tuple(args[1:]), kwargs
        if key in kwargs:
            return args, {**kwargs, key: run(kwargs[key])}
        raise TypeError(f"parallelize: expected the module's input as the first argument or '{key}='")

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def takes_sequence_shards(module: nn.Module) -> bool:
    """Whether ``module``'s input is this rank's chunk of the sequence: a sequence-parallel column layer or
    experts (tokens sent by all-to-all), a sequence-parallel norm, a module whose input sequence is gathered."""
    if getattr(module, "sequence_parallel", False) and not hasattr(module, "input_is_parallel"):  # (not a row layer)
        return hasattr(module, "gather_output") or hasattr(module, "_dispatch")
    return bool({"sequence_parallel_norm", "gather_sequence"} & set(getattr(module, MARK, ())))


@dataclass(frozen=True)
class _SequenceStyle:
    """Shared check (not applied twice to one module) and marking of the sequence styles."""

    style_name = ""
    runs_in_leaves = False  # a replicated module with partial parameter gradients: tp_invariant runs it leaf by leaf

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        if self.style_name in getattr(module, MARK, ()):
            raise ValueError(f"parallelize: module '{ctx.name}' already has the {self.style_name} hooks of an "
                             "earlier parallelize call")
        return Built(module, finish=lambda: self._apply(module, ctx), region=self._region())

    def _region(self) -> Optional[str]:
        return None

    def _apply(self, module: nn.Module, ctx: BuildContext) -> None:
        setattr(module, MARK, getattr(module, MARK, ()) + (self.style_name,))
        if ctx.group.size > 1 or ctx.tp_invariant and self.runs_in_leaves:  # (the leaves at TP 1 too)
            self._attach(module, ctx)

    def _attach(self, module: nn.Module, ctx: BuildContext) -> None:
        raise NotImplementedError


def _sum_partial_grads(module: nn.Module, ctx: BuildContext, local_leaves: Callable[[], int],
                       leaves: int = LEAVES) -> None:
    """The module's parameters' partial gradients summed over the group: by the call's ``PartialGradSum``, or with
    ``tp_invariant`` as the fixed tree over leaves of dim -2 of its input (``local_leaves()`` on this rank:
    `tplayers.convert.invariant.run_in_leaves`)."""
    if not ctx.tp_invariant:
        _reduce_param_grads(module, ctx)
        return
    run_in_leaves(module, ctx.group, local_leaves, ctx.name, leaves)
    if ctx.group.size > 1:
        _mark_partial(module, tuple(n for n, _ in module.named_parameters(recurse=False)))


def _mark_partial(module: nn.Module, names: Tuple[str, ...]) -> None:
    """``names`` carry ``Replicated(partial_grad=True)``: each rank's gradient is a partial sum, completed in
    autograd (the call's ``PartialGradSum``, or tp_invariant's leaf copies)."""
    setattr(module, PLACEMENTS_ATTR, {n: Replicated(partial_grad=True) for n in names})


def _reduce_param_grads(module: nn.Module, ctx: BuildContext, names: Optional[Tuple[str, ...]] = None,
                        local: Callable[[torch.Tensor], torch.Tensor] = lambda p: p) -> None:
    """The module's own parameters (``names``, default all) enter its forward through the call's
    ``PartialGradSum`` (their gradients summed over the group, every such module's by one all-reduce), read
    as ``local`` of them, and carry ``Replicated(partial_grad=True)``."""
    names = tuple(n for n, p in module.named_parameters(recurse=False)) if names is None else names
    partial = ctx.partial_grads if ctx.partial_grads is not None else PartialGradSum(ctx.group)
    partial.register(module, names)
    route_params_through(module, names, lambda p: local(partial.read(p)))
    _mark_partial(module, names)


@dataclass(frozen=True)
class ReplicateReduceGrad(_SequenceStyle):
    """A replicated module applied to this rank's shard of the activations, e.g. Qwen3's per-head
    ``q_norm`` / ``k_norm`` after a column-split projection: forward unchanged, each rank's
    parameter gradient covers only its heads, so the gradients are summed over the TP group."""

    style_name = "replicate_reduce_grad"
    runs_in_leaves = True

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        if ctx.tp_invariant:
            _head_leaves(ctx)  # (refused here, before anything changes)
        return super().build(module, ctx)

    def _attach(self, module: nn.Module, ctx: BuildContext) -> None:
        leaves = _head_leaves(ctx) if ctx.tp_invariant else LEAVES
        _sum_partial_grads(module, ctx, lambda: leaves // ctx.group.size, leaves)


def _head_leaves(ctx: BuildContext) -> int:
    """``tp_invariant``: how many leaves of whole heads a per-head module's weight gradient is summed over: the most,
    up to ``LEAVES``, that every head count of its attention divides (8 for 8k heads; Qwen3's small configs, 4 query
    and 4 KV heads: 4), the same at every degree (a property of the model); each rank then holds leaves / p."""
    heads = [n for n in attention_heads(ctx.parent) if n is not None] if ctx.parent is not None else []
    if any(n < ctx.group.size for n in heads):
        raise ValueError(f"parallelize: tp_invariant=True: module '{ctx.name}': its attention's head counts {heads} "
                         f"hold KV heads replicated over ranks (fewer than the TP degree {ctx.group.size}). "
                         + KV_REPLICAS_REASON)
    leaves = math.gcd(LEAVES, *heads) if heads else 0
    if not leaves or leaves % ctx.group.size:
        raise ValueError(f"parallelize: tp_invariant=True: module '{ctx.name}' (replicate_reduce_grad) sums its "
                         f"weight gradient over leaves of whole heads, as many as its attention's head counts "
                         f"{heads or 'unknown'} allow ({leaves or 'none'}, up to {LEAVES}); the TP degree "
                         f"{ctx.group.size} does not divide them")
    return leaves


@dataclass(frozen=True)
class PerHeadParams:
    """An attention's own parameters holding one value per query head along dim 0 (gpt-oss's attention
    ``sinks``, shape ``(heads,)``): kept whole on every rank (state-dict names and shapes unchanged), read
    during the attention's forward as this rank's heads' values, cut as ``Column(heads=True)`` cuts
    ``q_proj`` (padded with zeros where heads do not divide the TP degree). Each rank's gradient covers its
    heads only, so the gradients are summed over the group (with the call's other partial gradients: one
    all-reduce per forward). The head counts come from the attention (``attention_heads``), or from its parent for a
    module inside it (Cohere's q / k norms: weights ``(heads, head_dim)``). ``kv``: one value per KV head, cut as
    ``KVColumn`` cuts k_proj (replicas where fewer KV heads than ranks)."""

    names: Tuple[str, ...]
    kv: bool = False

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        try:
            heads, kv_heads = attention_heads(module)
        except AttributeError:  # (a module inside the attention: its parent keeps the counts)
            heads, kv_heads = attention_heads(ctx.parent) if ctx.parent is not None else (None, None)
        if heads is None:
            raise ValueError(f"parallelize: module '{ctx.name}' (PerHeadParams): the attention's query heads are not "
                             "known (config.num_attention_heads)")
        count, what = (kv_heads or heads, "KV head") if self.kv else (heads, "query head")
        for name in self.names:
            p = module._parameters.get(name)
            if p is None or p.dim() < 1 or p.shape[0] != count:
                raise ValueError(f"parallelize: module '{ctx.name}' (PerHeadParams): parameter '{name}' must have "
                                 f"one value per {what} along dim 0 ({count}), got "
                                 f"{None if p is None else tuple(p.shape)}")
        part = head_parts(heads, kv_heads, 1, ctx.group.size, ctx.name)[1 if self.kv else 0]
        placement = Sharded(0, (part,))

        def finish() -> None:
            tp = ctx.group
            if tp.size > 1:
                _reduce_param_grads(module, ctx, self.names, lambda p: placement.shard(p, tp.rank, tp.size))
        return Built(module, finish=finish, label=f"{type(module).__name__} reading this rank's heads of "
                                                  f"{', '.join(self.names)}")


@dataclass(frozen=True)
class SequenceParallelNorm(_SequenceStyle):
    """A norm (or any replicated module) inside a sequence-parallel region: it runs on this rank's
    sequence chunk, so its parameters' gradients are summed over the TP group (see the module
    docstring). ``gather_output=True`` also all-gathers its output along the sequence (the last
    norm, before a head that takes the full sequence)."""

    gather_output: bool = False
    style_name = "sequence_parallel_norm"
    runs_in_leaves = True

    def _region(self) -> Optional[str]:
        return "leave_sequence" if self.gather_output else None

    def _attach(self, module: nn.Module, ctx: BuildContext) -> None:
        # (with the switch off no gradient is recorded, so the reduction above is never reached)
        tp, switch = ctx.group, ctx.switch
        _sum_partial_grads(module, ctx, lambda: LEAVES // tp.size if switch.active else LEAVES)  # (off: whole)
        if self.gather_output and tp.size > 1:
            # the head after it takes the sequence-parallel path on this rank's chunk (what else reads the
            # gathered output gets its gradient split)
            module.register_forward_hook(lambda m, args, out: gather_sequence_for_columns(out, group=tp, inputs=ctx.column_inputs)
                                         if switch.active else out)


@dataclass(frozen=True)
class GatherSequence(_SequenceStyle):
    """Leave the sequence-parallel region for one module whose code needs the whole sequence
    (HF Llama attention reshapes with its input's shape): its first input (``hidden_states``) is
    all-gathered along the sequence. Its column layers called on that gathered input keep only this
    rank's chunk, gather it again in backward and reduce-scatter their summed input gradient
    (`tplayers.core.comm.gather_sequence_for_columns`); whatever else reads it gets its gradient split.
    ``then``: a style the module already has that keeps it in place (an attention's ``PerHeadParams``),
    applied with it."""

    then: Optional[PerHeadParams] = None
    style_name = "gather_sequence"

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        built = super().build(module, ctx)
        if self.then is None:
            return built
        other = self.then.build(module, ctx)
        own = built.finish

        def finish() -> None:
            own()
            if other.finish is not None:
                other.finish()
        return Built(module, finish=finish, region=built.region, label=other.label)

    def _attach(self, module: nn.Module, ctx: BuildContext) -> None:
        tp, switch = ctx.group, ctx.switch
        cast = CastGather(module)  # under autocast: the shard cast first where only column layers read it
        order = SortGather(module)  # rank-major where only column layers read its values

        def gather(x: torch.Tensor, called: nn.Module) -> torch.Tensor:
            if not switch.active:
                return x
            dtype = cast.before(x)
            x = x if dtype is None else x.to(dtype)
            own = called is module and not ctx.tp_invariant  # (a deep copy keeps the sequence's order)
            rank_major = own and order.rank_major(x)
            x_full = gather_sequence_for_columns(x, group=tp, inputs=ctx.column_inputs, rank_major=rank_major)
            cast.watch(x_full)
            if own and cast.watching is None and not rank_major:  # (one watch at a time)
                order.watch(x_full)
            return x_full

        def note_other_shards(m: nn.Module, args: tuple, kwargs: dict) -> None:  # (for the audit's verdict)
            first = args[0] if args else kwargs.get("hidden_states")
            if switch.active and isinstance(first, torch.Tensor):
                vars(m)[OTHER_SHARDS] = [f"argument {i}" for i, a in enumerate(args[1:], 1) if _like(a, first)] + \
                    [f"'{k}'" for k, a in kwargs.items() if a is not first and _like(a, first)]
        module.register_forward_pre_hook(note_other_shards, with_kwargs=True)
        map_first_input(module, gather, called=True)


@dataclass(frozen=True)
class ScatterSequence(_SequenceStyle):
    """Enter the sequence-parallel region: the module's first input (``hidden_states``) is cut to
    this rank's sequence chunk (``(b, s, h) -> (b, s/p, h)``); its gradient is all-gathered.

    A sequence length that does not divide the TP degree (the one-token steps of ``generate`` with
    a KV cache) switches the whole region off for that forward when no gradient is recorded: every
    layer and hook of the call runs the plain TP path. With autograd on it is refused."""

    style_name = "scatter_sequence"

    def _region(self) -> Optional[str]:
        return "enter_sequence"

    def _attach(self, module: nn.Module, ctx: BuildContext) -> None:
        tp, switch = ctx.group, ctx.switch

        def enter(x: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> (b, s/p, h)
            seq = x.shape[-2]
            if seq % tp.size and torch.is_grad_enabled():
                raise ValueError(f"sequence parallelism: the sequence length {seq} (dim -2 of the hidden states "
                                 f"entering '{type(module).__name__}') is not divisible by the TP degree {tp.size}; "
                                 f"pad it to a multiple of {tp.size}, or run this forward under torch.no_grad() "
                                 "(generate() does), which falls back to the non-sequence-parallel path")
            switch.set(seq % tp.size == 0)
            if isinstance(x, PartialSum):  # a vocabulary-parallel embedding's lookup, not summed yet
                return x.reduce_scatter() if switch.active else x.summed()
            return scatter_to_sequence(x, group=tp) if switch.active else x

        map_first_input(module, enter)


def check_sequence_region(plan_name: str, regions: Dict[str, Optional[str]]) -> None:
    """A plan that enters sequence parallelism (``scatter_sequence``, or a ``VocabEmbedding(sequence_parallel=True)``)
    must leave it (a gathering final norm) and the other way round; ``regions``: module name -> ``Built.region``."""
    enters = [n for n, r in regions.items() if r == "enter_sequence"]
    leaves = [n for n, r in regions.items() if r == "leave_sequence"]
    if bool(enters) != bool(leaves):
        raise ValueError(f"parallelize: plan '{plan_name}' enters sequence parallelism at {enters} but leaves it at "
                         f"{leaves}: it needs both an entry (a 'scatter_sequence' module or a "
                         "VocabEmbedding(sequence_parallel=True)) and a gathering final norm")


def refuse_double_gather(plan_name: str, style_of: Dict[str, object]) -> None:
    """Inside a module whose input is gathered along the sequence (``gather_sequence``), every layer sees the whole
    sequence: one that takes sequence shards there (a sequence-parallel column layer, a sequence style) would
    gather the gathered sequence again (p times too long: the module's own reshapes failed far from the plan)."""
    for outer, style in style_of.items():
        if not isinstance(style, GatherSequence):
            continue
        again = [n for n, st in style_of.items() if n.startswith(outer + ".") and (
            isinstance(st, _SequenceStyle) and not isinstance(st, ReplicateReduceGrad)
            or getattr(st, "sequence_parallel", False) and not isinstance(st, Row))]
        if again:
            raise ValueError(f"parallelize: plan '{plan_name}': '{outer}' gathers the sequence at its input "
                             f"('gather_sequence'), and {sorted(again)} inside it take sequence shards and would "
                             "gather it again; inside a gathered module keep the column layers plain ('column', "
                             "KVColumn) and make its output layer Row(sequence_parallel=True) (it reduce-scatters)")
