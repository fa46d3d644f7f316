"""Column -> Row: the two tensor-parallel linears, and where their communication hides.

An MLP ``row(act(column(x)))`` over p ranks (Megatron's f and g): the column layer holds 1/p of
the output features (rows of ``W1``), the row layer 1/p of the input features (columns of ``W2``)::

    forward   x (replicated) -> x @ W1_r^T -> act -> @ W2_r^T = partial sum -> all-reduce (g) -> y
    backward  grad_y -> @ W2_r, act' -> grad_h_r -> grad_h_r @ W1_r = partial -> all-reduce (f) -> grad_x

The only backward collective is the column layer's all-reduce of the input gradient (f). The
column layer's weight gradient needs no communication and does not depend on that all-reduce::

    Before (blocking)                        Now (this module)
    grad_x = grad_out @ W1                   grad_x = grad_out @ W1
    grad_x = all_reduce(grad_x)  # idle      pending = all_reduce(grad_x, async_op=True)
    grad_W1 = grad_out^T @ x                 grad_W1 = grad_out^T @ x   # while the all-reduce travels
                                             grad_x = pending.wait()

Under sequence parallelism (``sequence_parallel=True``) activations between the layers' regions are
split along the sequence: the column layer all-gathers its input (keeping only its shard for
backward, re-gathered in backward under the input-gradient GEMM) and reduce-scatters its input
gradient under the weight-gradient GEMM; the row layer reduce-scatters its output instead of
all-reducing it, and all-gathers its output gradient in backward. Each pass runs its GEMMs on the gathered
tokens in the order that copies less: the sequence's, or the collective's own (rank-major, :mod:`.seq_order`).

``overlap_comm=False`` runs the same ops with blocking collectives, in the same order: bit-identical
results, to measure what the overlap buys. ``collective_matmul`` cuts the sequence-parallel gather /
scatter into ring steps under the GEMMs (:mod:`.ring`). Weight gradients are returned to autograd
(``.grad``); a layer with float32 ``main_grad`` buffers or delay_wgrad hands them to its `WgradSink`
(:mod:`.wgrad`). Column layers declared siblings (q/k/v, gate/up: :mod:`.siblings`) take another route
when called together: their call's entry (f, once for the set) and its members (``_SetEntry``,
``_SetMemberFn``). The column -> core -> row region with both layers' backward ordered together is
:mod:`tplayers.regions.region`. What a call does before its Function (the shape / dtype / device checks,
autocast's cast: custom Functions do not get it) is at the end of this module.

CUDA launch order: an async NCCL collective runs on its own stream. With several hardware queues
(``CUDA_DEVICE_MAX_CONNECTIONS`` > 1, the default) the weight-gradient GEMM launched after it can be
scheduled first and take every SM; set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` before CUDA initializes for
full overlap. tplayers never sets it behind your back; it warns once when it is not set.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from .collectives import SEQ_DIM, Pending, from_rank_major, sum_partials, to_rank_major
from .comm import copy_to_tp, gather_from_sequence, scatter_to_tp
from .graph import column_graph_grads, differentiable_grads, graph_inputs, row_graph_grads
from .groups import GroupLike, TPGroup, refuse_replicating_wrapper, resolve_group
from .ring import ring_gather_linear, ring_linear_scatter
from .seq_order import (column_backward_rank_major, column_grad_order, gather_rank_major_from_sequence, gather_sequence,
                        gathered_linear, in_sequence_shape, rank_major_view, row_backward_rank_major,
                        row_forward_rank_major)
from .siblings import Siblings, joins_siblings
from .wgrad import MainGrads, WeightGradStore, WgradSink, check_main_grads, linear_wgrads

__all__ = ["column_parallel_linear", "row_parallel_linear", "check_linear_inputs",
           "autocast_inputs", "autocast_dtype", "warn_cuda_connections_once"]

Grads = Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]


class _ColumnParallelLinearFn(torch.autograd.Function):
    """``x @ W_r^T + b_r``: forward gathers x under SP; backward hides the input-gradient collective."""

    @staticmethod
    def forward(ctx, x, weight, bias, g: TPGroup, sequence_parallel: bool, overlap_comm: bool,
                sink: Optional[WgradSink], ring: bool):
        ctx.save_for_backward(x, weight)  # under sequence parallelism x is only this rank's shard
        ctx.g, ctx.sequence_parallel, ctx.overlap_comm, ctx.sink = g, sequence_parallel, overlap_comm, sink
        ctx.has_bias = bias is not None
        if sequence_parallel and ring:
            return ring_gather_linear(x, weight, bias, g)  # the gather in p ring steps under the GEMMs
        if sequence_parallel:  # the gather in the token order that copies less (seq_order)
            return gathered_linear(x, weight, bias, g)  # (..., s, out/p)
        return F.linear(x, weight, bias)  # (..., s, out/p)

    @staticmethod
    def backward(ctx, grad_out):  # (..., s, out/p)
        if torch.is_grad_enabled():  # create_graph=True: a backward that is itself differentiable
            return (*column_graph_grads(ctx, grad_out), None, None, None, None, None)
        x, weight = ctx.saved_tensors
        g, sp, overlap, sink = ctx.g, ctx.sequence_parallel, ctx.overlap_comm, ctx.sink
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        rank_major, grad_out = column_grad_order(grad_out, weight, g) if sp else (False, grad_out)  # (seq_order)
        if sp and need_w and (sink is None or sink.now):  # SP: the gather of x, in flight under the next GEMM
            x = gather_sequence(x, g, rank_major, async_op=overlap)  # (delay_wgrad: gathered so at its flush)
        # f: all-reduce (SP: reduce-scatter) this rank's partial sum, a buffer we own; (..., s[/p], in)
        reducing = sum_partials(grad_out @ weight, g, sp, async_op=overlap, rank_major=rank_major) if need_x else None
        grad_w, grad_b = _weight_grads(sink, grad_out, x, need_w, need_b and ctx.has_bias)  # under the collective
        grad_x = None if reducing is None else reducing.wait()
        return grad_x, grad_w, grad_b, None, None, None, None, None


class _RowParallelLinearFn(torch.autograd.Function):
    """``sum_r x_r @ W_r^T + b``: forward sums the partial products (g); the full bias once, after."""

    @staticmethod
    def forward(ctx, x, weight, bias, g: TPGroup, sequence_parallel: bool, sink: Optional[WgradSink], ring: bool):
        rank_major = sequence_parallel and (ring or row_forward_rank_major(weight))  # SP: seq_order's choice
        x_in = to_rank_major(x, g.size) if rank_major else x
        if sequence_parallel and ring:
            out = ring_linear_scatter(x_in, weight, g)  # the reduce-scatter in p ring steps under the GEMMs
        else:
            partial = F.linear(x_in, weight)  # (..., s, out): this rank's share of the sum, owned
            out = sum_partials(partial, g, sequence_parallel, rank_major=rank_major).wait()  # g: all-reduce (SP: r-s)
        if bias is not None:
            out = out.add_(bias)  # (out is a buffer we own)
        ctx.save_for_backward(x, weight)  # (x itself: create_graph differentiates through it; one copy of x kept)
        ctx.g, ctx.sequence_parallel, ctx.has_bias, ctx.ring, ctx.sink = g, sequence_parallel, bias is not None, ring, sink
        return out

    @staticmethod
    def backward(ctx, grad_out):  # (..., s, out), (..., s/p, out) under SP
        if torch.is_grad_enabled():  # create_graph=True: a backward that is itself differentiable
            return (*row_graph_grads(ctx, grad_out), None, None, None, None)
        x, weight = ctx.saved_tensors
        g, sp = ctx.g, ctx.sequence_parallel
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        rank_major = sp and (ctx.ring or row_backward_rank_major(weight))  # SP: seq_order's choice
        if sp and ctx.ring and need_x:  # the gather in p ring steps, each chunk's GEMM under the next transfer
            grad_full = grad_out.new_empty((g.size,) + grad_out.shape)  # (p, ..., s/p, out), filled by the ring
            grad_x = ring_gather_linear(grad_out, weight.t(), None, g, gathered=grad_full)
        else:  # SP: each rank holds its chunk's gradient; the GEMMs need all of it
            grad_full = gather_sequence(grad_out, g, rank_major).wait() if sp else grad_out
            grad_x = (from_rank_major(grad_full @ weight) if rank_major else grad_full @ weight) if need_x else None
        x = to_rank_major(x, g.size) if rank_major and need_w else x  # (the weight gradient's tokens in grad's order)
        grad_w, grad_b = _weight_grads(ctx.sink, grad_full, x, need_w, need_b and ctx.has_bias)
        return grad_x, grad_w, grad_b, None, None, None, None


class _SetEntry(torch.autograd.Function):
    """f for a call of declared siblings (:mod:`.siblings`): forward hands the members the input (SP: gathered
    once) and views of the weights it took; the members compute on those, so autograd runs this backward once
    every member this backward reaches has run, their partial input gradients summed. It launches the one
    all-reduce (SP: reduce-scatter), computes the weight gradients the members left it under it, and waits."""

    @staticmethod
    def forward(ctx, call, x, *weights):
        ctx.call, ctx.dtypes = call, [w.dtype for w in weights]
        ctx.set_materialize_grads(False)  # (an output no member used: None, not zeros, for its weight's .grad)
        ctx.save_for_backward(x)  # (SP: the shard) what the members' weight gradients multiply
        token = (call.x_full.detach() if call.x_full is not None else call.gather(x)) if call.sp else x.view_as(x)
        return (token, *(w.view_as(w) for w in weights))

    @staticmethod
    def backward(ctx, grad_x, *grad_views):  # grad_x: the members' partial sums, added by autograd (a buffer we own)
        call = ctx.call
        box = call.take_left()
        if torch.is_grad_enabled():  # create_graph=True: f (SP: the gather) rebuilt from differentiable ops
            f = (lambda t: gather_rank_major_from_sequence(t, group=call.g) if call.kept else gather_from_sequence(
                t, group=call.g, seq_dim=SEQ_DIM)) if call.sp else (lambda t: copy_to_tp(t, group=call.g))
            grad = None if grad_x is None else differentiable_grads(f, ctx.saved_tensors, (True,), grad_x)[0]
            return (None, grad, *grad_views)
        if grad_x is not None:  # (rank-major: the members' partials are in that order, seq_order.rank_major_view)
            grad_x = rank_major_view(grad_x, call.g.size) if call.rank_major else grad_x.contiguous()
        reducing = None if grad_x is None else sum_partials(grad_x, call.g, call.sp, async_op=call.overlap,
                                                            rank_major=call.rank_major)
        grads = list(grad_views)
        if box["left"]:
            (x,) = ctx.saved_tensors
            x_full = (box["gather"] or gather_sequence(x, call.g, call.rank_major)).wait() if call.sp else x
            for i, grad_out, main in box["left"]:  # every member's weight-gradient GEMM under the collective
                grad_w = linear_wgrads(grad_out, x_full, True, False, main, call.g)[0]
                if grad_w is not None:
                    grad_w = grad_w.to(ctx.dtypes[i])
                    grads[i] = grad_w if grads[i] is None else grads[i] + grad_w
        return (None, None if reducing is None else reducing.wait(), *grads)


class _SetMemberFn(torch.autograd.Function):
    """A member of a call: ``token @ W^T + b`` on its entry's input; backward returns its partial input gradient
    to the entry (which sums and reduces the set's once) and leaves the entry its weight-gradient GEMM when the
    entry took its weight (``index``), computing it here otherwise."""

    @staticmethod
    def forward(ctx, token, weight, bias, call, sink: Optional[WgradSink], index: Optional[int], own: torch.Tensor):
        # own: the tensor this member was called on, an input so that what hooks it (FSDP2's post-backward of a
        # member wrapped on its own) runs after this member's backward, given no gradient (the entry's carries it)
        ctx.save_for_backward(own if call.sp else token, weight)  # for a weight gradient made here (SP: the shard)
        ctx.call, ctx.sink, ctx.index, ctx.has_bias = call, sink, index, bias is not None
        out = F.linear(token, weight, bias)  # (..., s, out/p), rank-major when the call sorts it (its narrow side)
        return from_rank_major(rank_major_view(out, call.g.size)) if call.sorts else out

    @staticmethod
    def backward(ctx, grad_out):
        call, sink = ctx.call, ctx.sink
        x, weight = ctx.saved_tensors
        call.began()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph=True: the member's own GEMMs, differentiable (the entry reduces)
            x_full = call.regather(x) if call.sp else x
            inputs = (x_full.detach().requires_grad_(), weight, *graph_inputs(ctx, grad_out)[2:])
            return (*differentiable_grads(F.linear, inputs, ctx.needs_input_grad[:3], grad_out), None, None, None, None)
        if need_w and call.sp and (sink is None or sink.now):  # SP: the gather of x (once), under the GEMMs to come
            x = call.gathered_input(x, call.overlap)
        if call.rank_major:  # SP: the set's GEMMs in rank-major token order; the partial handed on in that order
            p = call.g.size  # (p, ..., s/p, out/p): the one reorder, none when the call kept its outputs so
            grad_out = rank_major_view(grad_out, p) if call.kept else to_rank_major(grad_out, p)
            grad_x = in_sequence_shape(grad_out @ weight) if need_x else None
        else:
            grad_x = grad_out @ weight if need_x else None  # (..., s, in): its partial sum, summed at the entry
        if need_w and ctx.index is not None:  # the entry runs its GEMM under the set's collective
            call.leave(ctx.index, grad_out, None if sink is None else sink.main)
            need_w = False
        grad_w, grad_b = _weight_grads(sink, grad_out, x, need_w, need_b and ctx.has_bias)
        return grad_x, grad_w, grad_b, None, None, None, None


def _set_member(call, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], g: TPGroup,
                overlap_comm: bool, store: Optional[WeightGradStore], main_grads: MainGrads) -> torch.Tensor:
    """A member's linear on its call (``x``: the call's input as the call computes on it); the call's first member
    applies its entry, which takes the set's weights."""
    if call.token is None:
        taken = call.owner.entry_weights()
        call.enter(_SetEntry.apply(call, x, *taken), overlap_comm, taken)
    index, weight_in = call.view_of(weight) if store is None else (None, weight)  # (delay_wgrad: records its own)
    _, weight_in, bias = autocast_inputs(call.token, weight_in, bias)
    if x.is_cuda:
        warn_cuda_connections_once(x, g, overlap_comm)
    sink = _sink(g, store, main_grads, weight_in, bias, "column_parallel_linear", call.sp)
    if sink is not None:  # (a recorded weight gradient gathers the input in the order of the set's gradients)
        sink.rank_major = call.rank_major
    return _SetMemberFn.apply(call.token, weight_in, bias, call, sink, index, x)


def _weight_grads(sink: Optional[WgradSink], grad_out: torch.Tensor, x: Union[torch.Tensor, Pending], need_w: bool,
                  need_b: bool) -> Grads:
    """``(grad_W, grad_b)`` of ``y = x W^T + b`` over all leading dims, each only when needed (``x``: its gather,
    waited for here); a layer's sink (main_grad buffers, delay_wgrad: :mod:`.wgrad`) takes them instead."""
    if sink is not None:
        return sink.linear(grad_out, x, need_w, need_b)
    x = x.wait() if isinstance(x, Pending) else x
    grad = grad_out.reshape(-1, grad_out.shape[-1])  # (tokens, out)
    return (grad.t() @ x.reshape(-1, x.shape[-1]) if need_w else None), (grad.sum(0) if need_b else None)


def _sink(g: TPGroup, store: Optional[WeightGradStore], main_grads: MainGrads, weight: torch.Tensor,
          bias: Optional[torch.Tensor], op: str, sequence_parallel: bool = False) -> Optional[WgradSink]:
    """Where the layer's weight gradients go when not to autograd now: None, or its `WgradSink`."""
    if store is None and main_grads is None:
        return None
    main = check_main_grads(main_grads, weight, bias, op, g.size)
    return WgradSink(g, store, main, (weight, bias), gather_input=sequence_parallel,
                     rank_major=sequence_parallel and column_backward_rank_major(weight))


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                           group: GroupLike, sequence_parallel: bool = False, overlap_comm: bool = True,
                           wgrad_store: Optional[WeightGradStore] = None, main_grads: MainGrads = None,
                           collective_matmul: bool = False, siblings: Optional[Siblings] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for this rank's output features: x ``(..., in)`` replicated, or ``(..., seq/p,
    in)`` with ``sequence_parallel``; weight ``(out/p, in)``; bias ``(out/p,)`` or None; returns ``(..., [seq,]
    out/p)``. ``wgrad_store`` (record the weight gradients for later) and ``main_grads`` (buffers the
    weight-gradient GEMM accumulates into, e.g. float32 ``main_grad``): :mod:`.wgrad`. ``siblings``: the layer's
    declared set (:mod:`.siblings`): its members called on one input reduce their summed input gradient once."""
    g = group if isinstance(group, TPGroup) else resolve_group(group)
    joins = siblings is not None and joins_siblings(siblings, x, g, collective_matmul)
    offered = siblings.inputs.take(x, g) if joins and not sequence_parallel else None
    if offered is not None:  # x: a sequence its module gathered (gather_sequence_for_columns); work on its shard
        x, sequence_parallel = offered[0], True
    check_linear_inputs("column_parallel_linear", x, weight, bias, weight.shape[1], g, sequence_parallel,
                        collective_matmul)
    if joins:  # a member of its set's call on this x: the call's entry reduces the set's input gradient once
        call, x = siblings.join(x, g, weight, sequence_parallel, autocast_dtype(x), offered)
        return _set_member(call, x, weight, bias, g, overlap_comm, wgrad_store, main_grads)
    x, weight, bias = autocast_inputs(x, weight, bias)
    if g.size == 1 and wgrad_store is None and main_grads is None:
        return F.linear(x, weight, bias)  # a world of one: exactly nn.Linear
    if x.is_cuda:
        warn_cuda_connections_once(x, g, overlap_comm)
    sink = _sink(g, wgrad_store, main_grads, weight, bias, "column_parallel_linear", sequence_parallel)
    return _ColumnParallelLinearFn.apply(x, weight, bias, g, sequence_parallel, overlap_comm, sink, collective_matmul)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                        group: GroupLike, input_is_parallel: bool = True, sequence_parallel: bool = False,
                        wgrad_store: Optional[WeightGradStore] = None, main_grads: MainGrads = None,
                        collective_matmul: bool = False) -> torch.Tensor:
    """Sum over ranks of ``x_shard @ weight_shard.T``, plus the full ``bias`` once: x ``(..., in/p)``
    (``input_is_parallel``) or ``(..., in)`` replicated, split here; weight ``(out, in/p)``; bias ``(out,)`` or
    None; returns ``(..., out)`` replicated, or ``(..., seq/p, out)`` with ``sequence_parallel``. No
    ``overlap_comm``: the row backward has no collective compute could hide. ``collective_matmul`` (with SP): the
    forward reduce-scatter and the backward gather of the output gradient as p ring steps under the GEMMs."""
    g = group if isinstance(group, TPGroup) else resolve_group(group)
    expected_in = weight.shape[1] * (1 if input_is_parallel else g.size)
    check_linear_inputs("row_parallel_linear", x, weight, bias, expected_in, g, sequence_parallel, collective_matmul,
                        seq_divisible=True)
    x, weight, bias = autocast_inputs(x, weight, bias)
    if g.size == 1 and wgrad_store is None and main_grads is None:
        return F.linear(x, weight, bias)  # a world of one: exactly nn.Linear
    if not input_is_parallel:
        x = scatter_to_tp(x, group=g)
    sink = _sink(g, wgrad_store, main_grads, weight, bias, "row_parallel_linear")
    return _RowParallelLinearFn.apply(x, weight, bias, g, sequence_parallel, sink, collective_matmul)


# ---------------------------------------------------------------------------- before the Function
#
# What a call does to its inputs before its autograd Function, locally (no communication). (Input values every
# rank holds whole, such as token ids, are checked in :mod:`.validate`.)


def check_linear_inputs(op: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        expected_in: int, g: TPGroup, sequence_parallel: bool, collective_matmul: bool = False,
                        seq_divisible: bool = False) -> None:
    """A ValueError / TypeError naming ``op`` unless ``x (..., expected_in)`` fits ``weight`` and ``bias``
    (``seq_divisible``: the sequence dim must split over the group, as a reduce-scatter needs); inside DDP, that
    its process group holds no two ranks of ``g`` (:func:`~.groups.refuse_replicating_wrapper`)."""
    if g.size > 1 and not torch.compiler.is_compiling() and DistributedDataParallel._active_ddp_module is not None:
        refuse_replicating_wrapper(op, g)
    if x.dim() < 1:
        raise ValueError(f"{op}: input is a 0-dim tensor, expected (..., {expected_in})")
    if x.shape[-1] != expected_in:
        raise ValueError(f"{op}: input's last dim is {x.shape[-1]} (shape {tuple(x.shape)}), expected {expected_in}")
    if x.device != weight.device:
        raise ValueError(f"{op}: input is on {x.device} but the weight is on {weight.device}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"{op}: input dtype {x.dtype} does not match the weight dtype {weight.dtype} "
                        "(cast the input or the module, or run under torch.autocast)")
    if bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"{op}: bias dtype {bias.dtype} does not match the weight dtype {weight.dtype}")
    if sequence_parallel or collective_matmul:
        _check_sequence(op, x, g, sequence_parallel, collective_matmul, seq_divisible)


def _check_sequence(op: str, x: torch.Tensor, g: TPGroup, sequence_parallel: bool, collective_matmul: bool,
                    seq_divisible: bool) -> None:
    """:func:`check_linear_inputs`' checks of a sequence-parallel input."""
    if sequence_parallel and x.dim() < 2:
        raise ValueError(f"{op}: sequence parallelism needs a [..., seq, hidden] input, got {tuple(x.shape)}")
    if collective_matmul and not sequence_parallel:
        raise ValueError(f"{op}: collective_matmul decomposes the sequence-parallel all-gather / reduce-scatter; "
                         "it needs sequence_parallel=True")
    if seq_divisible and sequence_parallel and g.size > 1 and x.shape[SEQ_DIM] % g.size != 0:
        raise ValueError(f"{op}: sequence length {x.shape[SEQ_DIM]} is not divisible by the TP degree {g.size} "
                         "(sequence parallelism splits it across ranks)")


# One cheap C call answering "is autocast on for any device?" (torch >= 2.4); it spares the
# per-call device-type lookup on the common path.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)


def autocast_inputs(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
                    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Autocast's cast, applied before a custom Function (which autocast does not see); unchanged
    when autocast is off."""
    dtype = autocast_dtype(x)
    if dtype is None:
        return x, weight, bias
    cast = lambda t: None if t is None else (t if t.dtype == dtype else t.to(dtype))  # noqa: E731
    return cast(x), cast(weight), cast(bias)


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast computes a linear layer on ``x`` in, or None when autocast is off."""
    on = _any_autocast() and torch.is_autocast_enabled(x.device.type)
    return torch.get_autocast_dtype(x.device.type) if on else None


_warned_cuda_connections = [False]


def warn_cuda_connections_once(x: torch.Tensor, g: TPGroup, overlap_comm: bool) -> None:
    """Warn once when overlap on CUDA may be lost to launch order (see `tplayers.core.functional`)."""
    if _warned_cuda_connections[0] or not overlap_comm or g.size == 1 or not x.is_cuda:
        return
    _warned_cuda_connections[0] = True
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        warnings.warn(
            "tplayers: CUDA_DEVICE_MAX_CONNECTIONS is not 1, so the GPU may schedule the "
            "weight-gradient GEMM ahead of the async input-gradient collective and serialize "
            "them. Results are unaffected; for full overlap export CUDA_DEVICE_MAX_CONNECTIONS=1 "
            "before CUDA initializes.",
            stacklevel=3,
        )
