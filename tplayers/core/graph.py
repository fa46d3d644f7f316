"""create_graph=True: a backward that is itself differentiable (a gradient penalty, a Hessian-vector product).

The fused Functions' backward (:mod:`.functional`) and the schedules' (:mod:`tplayers.regions`) are built there
from the differentiable collectives of :mod:`.comm` instead of their own: the same numbers, without the overlap,
and a graph autograd can differentiate again. Plain training never takes these paths.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .collectives import SEQ_DIM
from .comm import copy_to_tp, gather_from_sequence, reduce_from_tp, reduce_scatter_to_sequence

__all__ = ["differentiable_grads", "column_graph_grads", "row_graph_grads", "graph_inputs"]


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


def graph_inputs(ctx, grad_out):
    """``(x, weight, bias)`` for a differentiable rebuild; the bias (not saved: its gradient does not
    depend on its value) as a zero stand-in of its shape."""
    x, weight = ctx.saved_tensors
    return x, weight, grad_out.new_zeros(grad_out.shape[-1]).requires_grad_() if ctx.has_bias else None


def column_graph_grads(ctx, grad_out):
    g, sp = ctx.g, ctx.sequence_parallel

    def forward(x, w, b):  # f (SP: the gather) into this rank's columns (each sibling its own, here)
        return F.linear(gather_from_sequence(x, group=g, seq_dim=SEQ_DIM) if sp else copy_to_tp(x, group=g), w, b)

    return differentiable_grads(forward, graph_inputs(ctx, grad_out), ctx.needs_input_grad[:3], grad_out)


def row_graph_grads(ctx, grad_out):
    g, sp = ctx.g, ctx.sequence_parallel

    def forward(x, w, b):  # the partial sums through g (SP: the reduce-scatter), the replicated bias once
        partial = F.linear(x, w)
        out = reduce_scatter_to_sequence(partial, group=g, seq_dim=SEQ_DIM) if sp else reduce_from_tp(partial, group=g)
        return out if b is None else out + (copy_to_tp(b, group=g) if sp else b)  # SP: every chunk's share summed

    return differentiable_grads(forward, graph_inputs(ctx, grad_out), ctx.needs_input_grad[:3], grad_out)
