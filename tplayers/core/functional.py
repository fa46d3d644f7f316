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
all-reducing it, and all-gathers its output gradient in backward.

``overlap_comm=False`` runs the same ops with blocking collectives, in the same order: bit-identical
results, to measure what the overlap buys. ``collective_matmul`` cuts the sequence-parallel gather /
scatter into ring steps under the GEMMs (:mod:`.ring`). Where the weight gradients go (``.grad``,
float32 ``main_grad`` buffers, or later: delay_wgrad) is :mod:`.wgrad`'s `WgradSink`. The column ->
core -> row region with both layers' backward ordered together is :mod:`tplayers.regions.region`.

CUDA launch order: an async NCCL collective runs on its own stream. With several hardware queues
(``CUDA_DEVICE_MAX_CONNECTIONS`` > 1, the default) the weight-gradient GEMM launched after it can be
scheduled first and take every SM; set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` before CUDA initializes for
full overlap. tplayers never sets it behind your back; it warns once when it is not set.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .collectives import SEQ_DIM, all_gather, sum_partials
from .comm import copy_to_tp, gather_from_sequence, reduce_from_tp, reduce_scatter_to_sequence, scatter_to_tp
from .groups import GroupLike, TPGroup, resolve_group
from .ring import ring_gather_linear, ring_linear_scatter
from .siblings import Siblings, joins_siblings
from .prepare import autocast_dtype, autocast_inputs, check_linear_inputs, warn_cuda_connections_once
from .wgrad import MainGrads, WeightGradStore, WgradSink, check_main_grads

__all__ = ["column_parallel_linear", "row_parallel_linear", "differentiable_grads"]


class _ColumnParallelLinearFn(torch.autograd.Function):
    """``x @ W_r^T + b_r``: forward gathers x under SP; backward hides the input-gradient collective."""

    @staticmethod
    def forward(ctx, x, weight, bias, g: TPGroup, sequence_parallel: bool, overlap_comm: bool, sink: WgradSink,
                ring: bool, call=None):
        ctx.save_for_backward(x, weight)  # under sequence parallelism x is only this rank's shard
        ctx.g, ctx.sequence_parallel, ctx.overlap_comm, ctx.sink = g, sequence_parallel, overlap_comm, sink
        ctx.call = call  # this layer's call of its declared siblings: one all-reduce for all (core/siblings.py)
        if call is not None:
            call.register(ctx)
        ctx.has_bias = bias is not None
        if sequence_parallel and ring:
            return ring_gather_linear(x, weight, bias, g)  # the gather in p ring steps under the GEMMs
        if sequence_parallel:  # (..., s, in): once for a set of siblings
            x_full = call.gather(x) if call is not None else all_gather(x, SEQ_DIM, g).wait()
        else:
            x_full = x
        return F.linear(x_full, weight, bias)  # (..., s, out/p)

    @staticmethod
    def backward(ctx, grad_out):  # (..., s, out/p)
        if torch.is_grad_enabled():  # create_graph=True: a backward that is itself differentiable
            return (*_column_graph_grads(ctx, grad_out), None, None, None, None, None, None)
        x, weight = ctx.saved_tensors
        g, sp, overlap_comm, sink = ctx.g, ctx.sequence_parallel, ctx.overlap_comm, ctx.sink
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if sp and ctx.call is not None and need_w and sink.now:  # one gather for the call's weight gradients
            x_full = ctx.call.gathered_input(x, overlap_comm)
        else:
            x_full = sink.input(x, need_w, async_op=overlap_comm)  # SP: the gather of x, in flight under the next GEMM
        grad_x = reducing = None
        if need_x:
            grad_x = grad_out @ weight  # (..., s, in): this rank's partial sum, a buffer we own
            if ctx.call is not None:  # summed with the other members': the last one gets the all-reduce
                reducing = ctx.call.add_partial(grad_x, overlap_comm)
            else:
                reducing = sum_partials(grad_x, g, sp, async_op=overlap_comm)  # f: all-reduce (SP: reduce-scatter)
        grad_w, grad_b = sink.linear(grad_out, x_full, need_w, need_b and ctx.has_bias)  # under the collective
        if reducing is not None:
            grad_x = reducing.wait()
        elif ctx.call is not None:
            grad_x = None  # (in the call's sum, which its last member returns)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class _RowParallelLinearFn(torch.autograd.Function):
    """``sum_r x_r @ W_r^T + b``: forward sums the partial products (g); the full bias once, after."""

    @staticmethod
    def forward(ctx, x, weight, bias, g: TPGroup, sequence_parallel: bool, sink: WgradSink, ring: bool):
        if sequence_parallel and ring:
            out = ring_linear_scatter(x, weight, g)  # the reduce-scatter in p ring steps under the GEMMs
        else:
            partial = F.linear(x, weight)  # (..., s, out): this rank's share of the sum, owned
            out = sum_partials(partial, g, sequence_parallel).wait()  # g: all-reduce (SP: reduce-scatter)
        if bias is not None:
            out = out.add_(bias)  # (out is a buffer we own)
        ctx.save_for_backward(x, weight)
        ctx.g, ctx.sequence_parallel, ctx.has_bias, ctx.ring, ctx.sink = g, sequence_parallel, bias is not None, ring, sink
        return out

    @staticmethod
    def backward(ctx, grad_out):  # (..., s, out), (..., s/p, out) under SP
        if torch.is_grad_enabled():  # create_graph=True: a backward that is itself differentiable
            return (*_row_graph_grads(ctx, grad_out), None, None, None, None)
        x, weight = ctx.saved_tensors
        g, sp = ctx.g, ctx.sequence_parallel
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if sp and ctx.ring and need_x:  # the gather in p ring steps, each chunk's GEMM under the next transfer
            grad_full = grad_out.new_empty(x.shape[:-1] + grad_out.shape[-1:])  # (..., s, out), filled by the ring
            grad_x = ring_gather_linear(grad_out, weight.t(), None, g, gathered=grad_full)
        else:  # SP: each rank holds its sequence chunk's gradient; the GEMMs need all of it
            grad_full = all_gather(grad_out, SEQ_DIM, g).wait() if sp else grad_out
            grad_x = grad_full @ weight if need_x else None  # (..., s, in/p)
        grad_w, grad_b = ctx.sink.linear(grad_full, x, need_w, need_b and ctx.has_bias)
        return grad_x, grad_w, grad_b, None, None, None, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                           group: GroupLike, sequence_parallel: bool = False, overlap_comm: bool = True,
                           wgrad_store: Optional[WeightGradStore] = None, main_grads: MainGrads = None,
                           collective_matmul: bool = False, siblings: Optional[Siblings] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for this rank's output features; output is sharded on the last dim.

    x: ``(..., in)`` replicated, or ``(..., seq/p, in)`` with ``sequence_parallel``.
    weight: ``(out/p, in)``; bias: ``(out/p,)`` or None. Returns ``(..., [seq,] out/p)``.
    ``wgrad_store``: backward computes only the input gradient and records the weight and bias
    gradients there (:class:`~tplayers.core.wgrad.WeightGradStore`, run by its ``flush``).
    ``main_grads``: ``(weight buffer, bias buffer or None)``, e.g. float32 ``main_grad`` buffers:
    the weight-gradient GEMM accumulates into them (``addmm``; on CUDA in float32 from bfloat16
    inputs) and returns no gradient for those parameters (Megatron's gradient_accumulation_fusion).
    A buffer wrapped in `tplayers.core.wgrad.ReplicatedRows` has its replicated rows' contribution
    summed over their replica ranks first (collective: every rank of the group runs the backward).
    ``siblings``: the layer's declared set (:class:`~tplayers.core.siblings.Siblings`): the members called on
    one input sum their partial input gradients and reduce them once; None: the layer reduces its own.
    """
    g = resolve_group(group)
    joins = joins_siblings(siblings, x, g, collective_matmul)
    offered = siblings.inputs.take(x, g) if joins and not sequence_parallel else None
    if offered is not None:  # x: a sequence its module gathered (gather_sequence_for_columns); work on its shard
        x, sequence_parallel = offered[0], True
    check_linear_inputs("column_parallel_linear", x, weight, bias, weight.shape[1], g, sequence_parallel,
                        collective_matmul)
    # a call of the set is joined on the tensor the layers were called on, before autocast's cast: it casts once
    call = siblings.join(x, g, weight, sequence_parallel) if joins else None
    x_cast = x if call is None else call.cast(x, autocast_dtype(x))
    x, weight, bias = autocast_inputs(x_cast, weight, bias)
    if g.size == 1 and wgrad_store is None and main_grads is None:
        return F.linear(x, weight, bias)  # a world of one: exactly nn.Linear
    warn_cuda_connections_once(x, g, overlap_comm)
    main = check_main_grads(main_grads, weight, bias, "column_parallel_linear", g.size)
    sink = WgradSink(g, wgrad_store, main, (weight, bias), gather_input=sequence_parallel)
    if offered is not None and call.x_full is None:
        call.x_full = offered[1].to(x.dtype)  # the call's forward gather, done already (cast as x under autocast)
    return _ColumnParallelLinearFn.apply(x, weight, bias, g, sequence_parallel, overlap_comm, sink, collective_matmul,
                                         call)  # q/k/v, gate/up ... called on this same x


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                        group: GroupLike, input_is_parallel: bool = True, sequence_parallel: bool = False,
                        wgrad_store: Optional[WeightGradStore] = None, main_grads: MainGrads = None,
                        collective_matmul: bool = False) -> torch.Tensor:
    """Sum over ranks of ``x_shard @ weight_shard.T``, plus the full ``bias`` once.

    x: ``(..., in/p)`` (``input_is_parallel``) or ``(..., in)`` replicated, which is split here.
    weight: ``(out, in/p)``; bias: ``(out,)`` or None. Returns ``(..., out)`` replicated, or
    ``(..., seq/p, out)`` with ``sequence_parallel``. The row backward has no collective that compute
    could hide, so it takes no ``overlap_comm``. ``wgrad_store``, ``main_grads``: as
    :func:`column_parallel_linear`'s. ``collective_matmul`` (with ``sequence_parallel``): the forward
    reduce-scatter runs as p ring steps, each block's GEMM under the running sum's transfer, and the
    backward all-gather of the output gradient as p ring steps, each chunk's input-gradient GEMM under
    the next chunk's transfer.
    """
    g = resolve_group(group)
    expected_in = weight.shape[1] * (1 if input_is_parallel else g.size)
    check_linear_inputs("row_parallel_linear", x, weight, bias, expected_in, g, sequence_parallel, collective_matmul,
                        seq_divisible=True)
    x, weight, bias = autocast_inputs(x, weight, bias)
    if g.size == 1 and wgrad_store is None and main_grads is None:
        return F.linear(x, weight, bias)  # a world of one: exactly nn.Linear
    if not input_is_parallel:
        x = scatter_to_tp(x, group=g)
    main = check_main_grads(main_grads, weight, bias, "row_parallel_linear", g.size)
    sink = WgradSink(g, wgrad_store, main, (weight, bias))
    return _RowParallelLinearFn.apply(x, weight, bias, g, sequence_parallel, sink, collective_matmul)


# ---------------------------------------------------------------------------- create_graph=True
#
# Under create_graph=True (a gradient penalty, a Hessian-vector product) a backward is built from the
# differentiable collectives of `comm` instead: the same numbers, without the overlap, and a graph
# that autograd can differentiate again. Plain training never takes these paths.


def differentiable_grads(forward, inputs, needs, grad_out: torch.Tensor):
    """The gradients of ``forward(*inputs)`` for the inputs that need one (None elsewhere), with
    ``create_graph=True``: ``forward`` rebuilt from differentiable ops (the fused Functions' and the
    schedules' backward under create_graph)."""
    wanted = [i for i, (t, need) in enumerate(zip(inputs, needs)) if need and t is not None]
    out = forward(*inputs)
    grads = torch.autograd.grad(out, [inputs[i] for i in wanted], grad_out, create_graph=True)
    result = [None] * len(inputs)
    for i, grad in zip(wanted, grads):
        result[i] = grad
    return result


def _graph_inputs(ctx, grad_out):
    """``(x, weight, bias)`` for a differentiable rebuild; the bias (not saved: its gradient does not
    depend on its value) as a zero stand-in of its shape."""
    x, weight = ctx.saved_tensors
    return x, weight, grad_out.new_zeros(grad_out.shape[-1]).requires_grad_() if ctx.has_bias else None


def _column_graph_grads(ctx, grad_out):
    g, sp = ctx.g, ctx.sequence_parallel

    def forward(x, w, b):  # f (SP: the gather) into this rank's columns (each sibling its own, here)
        return F.linear(gather_from_sequence(x, group=g, seq_dim=SEQ_DIM) if sp else copy_to_tp(x, group=g), w, b)

    return differentiable_grads(forward, _graph_inputs(ctx, grad_out), ctx.needs_input_grad[:3], grad_out)


def _row_graph_grads(ctx, grad_out):
    g, sp = ctx.g, ctx.sequence_parallel

    def forward(x, w, b):  # the partial sums through g (SP: the reduce-scatter), the replicated bias once
        partial = F.linear(x, w)
        out = reduce_scatter_to_sequence(partial, group=g, seq_dim=SEQ_DIM) if sp else reduce_from_tp(partial, group=g)
        return out if b is None else out + (copy_to_tp(b, group=g) if sp else b)  # SP: every chunk's share summed

    return differentiable_grads(forward, _graph_inputs(ctx, grad_out), ctx.needs_input_grad[:3], grad_out)
