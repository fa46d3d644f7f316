"""Tensor-parallel MoE experts: every rank holds 1/p of every expert's ffn.

Hugging Face MoE families (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek, Granite-MoE ...) keep their routed
experts as one module of 3-D parameters, e.g. ``gate_up_proj (experts, 2 * ffn, h)`` and
``down_proj (experts, h, ffn)``, and a forward ``experts(hidden_states, top_k_index, top_k_weights)``
that loops (or runs grouped GEMMs) over the experts the router picked. Megatron's MLP split applies
to each expert unchanged: the up (and gate) rows and the down columns of every expert are cut into
``p`` slices, so each rank computes its slice of every expert's ffn on every routed token and the
partial outputs are summed once::

    hidden (tokens, h), top_k_weights (tokens, k)   whole on every rank (the router is replicated)
        f: forward identity; backward ONE all-reduce of both inputs' gradients
    rank r: for each expert e: act(x @ gate_e,r.T) * (x @ up_e,r.T) @ down_e,r.T * weight  (a partial sum)
        g: forward all-reduce of the partial outputs; backward identity
    out (tokens, h)                                  whole on every rank

The routing weights enter the experts (each expert's output is scaled by its weight), so their
gradient is a per-rank partial sum like the tokens': both are summed by one all-reduce (packed into
one buffer when the weights' dtype converts exactly into the tokens', see :func:`copy_many_to_tp`).

:class:`ParallelExperts` is made from the model's own experts module: the same class, attributes and
forward (a subclass built once per experts class), with its parameters replaced by this rank's
shards, so whatever the family's code reads (``self.num_experts``, ``self.act_fn``, its experts
implementation: eager loop, ``grouped_mm``, ``batched_mm``) is unchanged. Which parameter is cut along
which dim is data (``splits``), as transformers' plans give it (``packed_colwise`` ...).

A parameter added after the expert's down projection (gpt-oss's ``down_proj_bias``) would be added by
every rank to its partial sum, ``p`` times in all: named in ``added_once``, it stays whole on every rank
and reads as itself on rank 0 and as zeros elsewhere during the forward; its gradient (rank 0's, whole)
enters f with the tokens', so the same one all-reduce makes it complete on every rank.

Every parameter cut along dim 0 instead means **whole experts per rank** (expert parallelism over the
TP group): rank r holds experts ``[r E/p, (r + 1) E/p)``; the tokens are the same on every rank, so the
router's expert ids are made local (another rank's expert becomes the sentinel ``num_experts``, which
transformers' experts implementations skip, its routing weight zeroed) and the same f and g sum the
ranks' shares. Or, ``dispatch="all_to_all"``, each rank sends its share of the routed tokens to the
experts' ranks and gets the outputs back (:mod:`~tplayers.layers.token_dispatch`): no all-reduce, and
the one layout for ranks holding different tokens (``sequence_parallel=True``).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..core.comm import copy_many_to_tp, reduce_from_tp
from ..core.groups import GroupLike, resolve_group
from ..core.placement import Placement, Replicated
from .base import TensorParallelModule, mixed_class, module_copy, params_read_as
from .expert_layout import ExpertSplit, check_dispatch, check_params, expert_placements
from .token_dispatch import dispatch_to_experts, tied_to

__all__ = ["ParallelExperts"]


Slot = Tuple[Any, Any]  # (the list of positional arguments or the kwargs dict, the index or key)


def _routing_slots(args: List[Any], kwargs: Dict[str, Any]) -> Tuple[Optional[Slot], Optional[Slot], List[Slot]]:
    """Where an experts call ``(hidden_states, top_k_index, top_k_weights)`` holds its tensors, positional or
    keyword: the tokens (the first floating tensor), the routed expert ids (the integer tensor) and the routing
    weights (the other floating tensors of the ids' shape)."""
    slots = [(args, i) for i in range(len(args))] + [(kwargs, k) for k in kwargs]
    tensors = [(box, key) for box, key in slots if torch.is_tensor(box[key])]
    hidden = next(((box, key) for box, key in tensors if box[key].is_floating_point()), None)
    index = next(((box, key) for box, key in tensors if not box[key].is_floating_point()), None)
    weights = [] if index is None else [
        (box, key) for box, key in tensors if box[key].is_floating_point() and box[key].shape == index[0][index[1]].shape
        and not (box is hidden[0] and key == hidden[1])]
    return hidden, index, weights


class _ShareOfInput(nn.Module):
    """An identity expert under TP: its input / p, so the partial sums over the ranks add it once."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.size


class _ZeroPaddingGrad(torch.autograd.Function):
    """``p`` itself (a view); backward its gradient with the padding of an uneven split zeroed, so padding
    rows stay zero whatever the experts' activation gives at zero."""

    @staticmethod
    def forward(ctx, p: torch.Tensor, dim: int, real: Tuple[Tuple[int, int], ...]) -> torch.Tensor:
        ctx.dim, ctx.real = dim, real
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape = [1] * grad.dim()
        shape[ctx.dim] = grad.shape[ctx.dim]
        mask = grad.new_zeros(shape)  # 1 on this rank's real features along the split dim
        for start, length in ctx.real:
            mask.narrow(ctx.dim, start, length).fill_(1)
        return grad * mask, None, None


GROUPED_MM_ALIGN = 16  # bytes: torch's grouped_mm (CPU and CUDA) needs every stride a multiple of this


def _eager_where_grouped_mm_cannot(new: nn.Module, widths: set) -> None:
    """A Hugging Face experts module that runs ``grouped_mm`` (``config._experts_implementation``) takes the
    eager loop instead where this rank's ffn width is too narrow for its strides in 2-byte floats (bf16: a
    multiple of 8): e.g. Qwen3-MoE's ffn of 12 at TP 2 gives 6 per rank, and ``grouped_mm`` raised "strides should
    be multiple of 16 bytes" in forward, backward and generate. The module gets a copy of its config (the model's
    is unchanged; the dense twin and ``to_dense`` get the original back); ``coverage`` names the switch."""
    config = getattr(new, "config", None)
    narrow = sorted(w for w in widths if (2 * w) % GROUPED_MM_ALIGN)
    if not narrow or getattr(config, "_experts_implementation", None) != "grouped_mm":
        return
    own = copy.deepcopy(config)  # (a deep copy: the setter also sets every sub-config's)
    own._experts_implementation = "eager"
    new._dense_attrs["config"] = config
    new.config = own
    new._coverage_note = (f"experts implementation 'eager' (this rank's ffn width {narrow[0]} is too narrow for "
                          f"grouped_mm's {GROUPED_MM_ALIGN}-byte strides in bf16)")


class ParallelExperts(TensorParallelModule):
    """A Hugging Face-style experts module (3-D parameters, one slice per expert) with each expert's
    ffn split across the TP group; see the module docstring. Built by :meth:`from_dense` only:
    the result is an instance of the dense module's own class as well."""

    _dense_class: type
    _splits: Dict[str, Placement]
    _dense_attrs: Dict[str, Any]  # attributes changed from the dense module's, with their dense values
    _first_expert: Optional[int]  # whole experts per rank: this rank's first expert (None: each ffn split)
    _dense_children: Dict[str, nn.Module]  # the identity experts replaced by _ShareOfInput
    _added_once: Tuple[str, ...] = ()  # parameters added after the partial products, by rank 0 only
    _dispatch: str = "all_reduce"  # whole experts: "all_to_all" sends the tokens to them (token_dispatch)
    sequence_parallel: bool = False  # all-to-all: each rank's tokens are its own (a sequence switch may flip it)
    _padding: Dict[str, Tuple[int, Tuple[Tuple[int, int], ...]]] = {}  # uneven ffn: parameter -> (split dim,
    # (local start, length) of this rank's real features)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, splits: Sequence[ExpertSplit] = (),
                   divide_attrs: Sequence[str] = ("intermediate_dim", "intermediate_size", "expert_dim"),
                   identity_experts: Sequence[str] = (), added_once: Sequence[str] = (), dispatch: str = "all_reduce",
                   sequence_parallel: bool = False) -> "ParallelExperts":
        """This rank's shard of ``dense`` (which is left as it is). ``splits``: ``(name, dim, parts)``
        for every parameter; ``divide_attrs``: int attributes holding the ffn size (divided by p
        where present); ``identity_experts``: child ``nn.Identity`` experts (LongCat-Flash's zero
        experts), which every rank would add whole to its partial sum: each adds 1/p of its input;
        ``added_once``: parameters added after the partial products (a bias of the down projection),
        kept whole and added by rank 0 only (see the module docstring); ``dispatch`` (whole experts per
        rank): ``"all_reduce"`` (every rank runs its experts on every token, the partial outputs summed) or
        ``"all_to_all"`` (each routed pair sent to its expert's rank and back:
        :mod:`~tplayers.layers.token_dispatch`); ``sequence_parallel`` (``"all_to_all"`` only): the tokens
        are this rank's own, not the same on every rank."""
        g = resolve_group(group)
        what = f"ParallelExperts({type(dense).__name__})"
        whole, experts = check_dispatch(dense, what, splits, dispatch, sequence_parallel)
        params, added_once = check_params(dense, what, splits, added_once, whole)
        placements, uneven, part, ffn_size = expert_placements(what, splits, params, whole, g, added_once)
        for name in identity_experts:
            if not isinstance(getattr(dense, name, None), nn.Identity):
                raise ValueError(f"{what}: identity expert '{name}' is a {type(getattr(dense, name, None)).__name__}, "
                                 "not an nn.Identity")
        if identity_experts and whole:
            raise ValueError(f"{what}: identity experts with whole experts per rank are not supported (split each "
                             "expert's ffn instead)")
        new = module_copy(dense, mixed_class(ParallelExperts, type(dense)))
        new.group, new._dense_class, new._splits, new._dense_attrs = g, type(dense), placements, {}
        new._added_once = added_once
        new._dense_children = {name: dense._modules[name] for name in identity_experts}
        for name in identity_experts:
            new._modules[name] = _ShareOfInput(g.size)
        new._first_expert = None
        new._dispatch, new.sequence_parallel = dispatch, bool(sequence_parallel)
        if whole:  # the router's expert ids become local ones; other ranks' experts the sentinel num_experts
            new._first_expert = g.rank * (experts // g.size)
            new._dense_attrs["_is_expert_parallel"] = getattr(dense, "_is_expert_parallel", None)
            new._is_expert_parallel = True  # transformers' experts implementations then skip the sentinel
            divide_attrs = ("num_experts",)
        for attr in divide_attrs:
            value = getattr(dense, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                padded = uneven and value == ffn_size  # the largest piece: every rank's local width
                if value % g.size and not padded:
                    raise ValueError(f"{what}: {attr}={value} is not divisible by the TP degree {g.size}")
                new._dense_attrs[attr] = value
                setattr(new, attr, part.local_size if padded else value // g.size)
        new._padding = {}
        for name, placement in placements.items():
            p = params[name]
            local = placement.shard(p.detach(), g.rank, g.size).clone(memory_format=torch.contiguous_format)
            new._parameters[name] = nn.Parameter(local, requires_grad=p.requires_grad)
            real = tuple((pc.local_start, pc.length) for pc in placement.pieces(g.rank, g.size))
            if uneven and sum(n for _, n in real) < local.shape[placement.dim]:  # (the rest: zero padding)
                new._padding[name] = (placement.dim, real)
        if not whole:
            _eager_where_grouped_mm_cannot(new, {new._parameters[n].shape[d % params[n].dim()] // k for n, d, k in splits})
        return new

    def param_placements(self) -> Dict[str, Placement]:
        return {**self._splits, **{name: Replicated() for name in self._added_once}}

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._dispatch == "all_to_all":
            return self._forward_all_to_all(args, kwargs)
        # f: the floating inputs (the tokens, the routing weights) enter whole; their gradients are partial
        # sums over ranks (each rank's slice of every expert), summed by one all-reduce backward (with the
        # added-once parameters' gradients, whole on rank 0)
        floats = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.is_floating_point()]
        keys = [k for k, v in kwargs.items() if torch.is_tensor(v) and v.is_floating_point()]
        once = [self._parameters[n] for n in self._added_once]
        entered = copy_many_to_tp([args[i] for i in floats] + [kwargs[k] for k in keys] + once, group=self.group)
        entered, once = list(entered[:len(entered) - len(once)]), entered[len(entered) - len(once):]
        args = list(args)
        for i, t in zip(floats + keys, entered):
            if isinstance(i, int):
                args[i] = t
            else:
                kwargs[i] = t
        if self._first_expert is not None:
            self._route_to_local_experts(args, kwargs)
        # rank 0 adds the added-once parameters (the partial sums then hold them once); padding rows: zero, and no
        # gradient (act(0) may not be 0)
        reads = [(self, name, t if self.group.rank == 0 else t * 0) for name, t in zip(self._added_once, once)]
        reads += [(self, name, _ZeroPaddingGrad.apply(self._parameters[name], dim, real))
                  for name, (dim, real) in self._padding.items()]
        with params_read_as(reads):
            out = super().forward(*args, **kwargs)  # (tokens, h): this rank's partial sum
        if not torch.is_tensor(out):
            raise TypeError(f"ParallelExperts({self._dense_class.__name__}): the experts returned "
                            f"{type(out).__name__}; a tensor (the weighted sum of the experts' outputs) was expected")
        out = self._idle_experts_tied(out)
        if entered and torch.is_grad_enabled():
            # a rank none of whose experts got a token returns zeros that autograd cannot trace back to f:
            # its backward would skip f's all-reduce while the other ranks wait in theirs
            out = tied_to(out, *entered)
        return reduce_from_tp(out, group=self.group)  # g

    def _forward_all_to_all(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> torch.Tensor:
        """Whole experts per rank, tokens sent to them (:func:`~tplayers.layers.token_dispatch.dispatch_to_experts`):
        the family's own forward runs on the rows this rank received, one local expert each."""
        args = list(args)
        hidden, index, weights = _routing_slots(args, kwargs)
        tensors = sum(torch.is_tensor(v) for v in (*args, *kwargs.values()))
        if hidden is None or index is None or len(weights) != 1 or tensors != 3:
            raise TypeError(f"ParallelExperts({self._dense_class.__name__}): the all-to-all dispatch needs a forward "
                            "of (hidden_states, top_k_index, top_k_weights) tensors; this call got "
                            f"{[type(v).__name__ for v in (*args, *kwargs.values())]}")
        slots = (hidden, index, weights[0])

        def run_experts(rows: torch.Tensor, ids: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
            call_args, call_kwargs = list(args), dict(kwargs)
            for (box, key), value in zip(slots, (rows, ids, ones)):
                (call_args if box is args else call_kwargs)[key] = value
            return self._idle_experts_tied(super(ParallelExperts, self).forward(*call_args, **call_kwargs))

        (x, ids, w) = (box[key] for box, key in slots)
        return dispatch_to_experts(run_experts, x, ids, w, group=self.group,
                                   num_experts=self._dense_attrs["num_experts"],
                                   sequence_parallel=self.sequence_parallel)

    def _idle_experts_tied(self, out: torch.Tensor) -> torch.Tensor:
        """Whole experts: ``out`` of a rank none of whose experts got a token comes from no parameter of theirs.
        Tied to the trained ones with a zero gradient, they get zeros, as the dense model's 3-D parameters do
        (their slices of experts nobody used): not None, which DDP refuses (a parameter without a gradient)
        and optimizers with momentum or weight decay skip (a step the dense model takes). It also takes this
        rank's backward through the exchange the other ranks wait in."""
        if torch.is_grad_enabled() and not out.requires_grad:
            trained = [p for p in self.parameters() if p.requires_grad]
            if trained:
                return tied_to(out, *trained)
        return out

    def _route_to_local_experts(self, args: List[Any], kwargs: Dict[str, Any]) -> None:
        """Whole experts per rank: the routed expert ids (the integer tensor argument, ``top_k_index``)
        become this rank's local ids, and another rank's expert the sentinel ``num_experts`` (which
        transformers' experts skip); the routing weights (the float tensor of the same shape) are zeroed
        there, so this rank's output and gradients hold its own experts' share only."""
        _, index, weights = _routing_slots(args, kwargs)
        if index is None:
            raise TypeError(f"ParallelExperts({self._dense_class.__name__}): whole experts per rank need the routed "
                            "expert ids as an integer tensor argument (top_k_index); this forward got none")
        box, key = index
        local = box[key] - self._first_expert
        mine = (local >= 0) & (local < self.num_experts)
        box[key] = torch.where(mine, local, torch.full_like(local, self.num_experts))
        for box, key in weights:
            box[key] = box[key] * mine.to(box[key].dtype)

    def to_dense(self) -> nn.Module:
        """The dense experts module (collective: every rank gathers every shard)."""
        dense = module_copy(self, self._dense_class)
        for attr in ("group", "_dense_class", "_splits", "_dense_attrs", "_first_expert", "_dense_children",
                     "_added_once", "_padding", "_dispatch", "sequence_parallel", "_coverage_note"):
            dense.__dict__.pop(attr, None)
        dense._modules.update(self._dense_children)
        for attr, value in self._dense_attrs.items():
            if value is None:
                dense.__dict__.pop(attr, None)
            else:
                dense.__dict__[attr] = value
        for name in self._splits:
            p = self._parameters[name]
            dense._parameters[name] = nn.Parameter(self.gather_param(name), requires_grad=p.requires_grad)
        return dense

    def extra_repr(self) -> str:
        if self._first_expert is not None:
            how = (f", tokens sent by all-to-all, sequence_parallel={self.sequence_parallel}"
                   if self._dispatch == "all_to_all" else "")
            return (f"tp={self.group.size}, whole experts [{self._first_expert}, "
                    f"{self._first_expert + self.num_experts}) on this rank{how}")
        cuts = ", ".join(f"{n}: dim {pl.dim} / {self.group.size}" for n, pl in self._splits.items())
        return f"tp={self.group.size}, {cuts}"
