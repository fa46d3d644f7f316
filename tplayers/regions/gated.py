"""A set of column layers -> token-wise code -> a row layer, the tokens rank-major all the way (sequence parallelism).

A Hugging Face gated MLP is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: a declared set (gate, up), then
token-wise code, then a row layer. Under sequence parallelism with a batch, the collectives' own token order is
rank-major, ``(p, b, s/p, ·)`` (``core/seq_order.py``); each layer on its own put its per-rank side back into the
sequence's order::

    Each layer on its own (TP 8, Llama-3 widths)     Kept rank-major (here)
    gate / up: gather x, reorder it (1 activation)   gate / up: gather x, as it lands
    down: reorder its input (0.44)                   down: its input as it is
    backward: down's gradient and input (0.88),      backward: nothing reordered
              gate / up's output gradients (0.88)

The set's call keeps its outputs rank-major (``ColumnInputs.keep_rank_major``: they keep the sequence's shape,
``(b, s, ffn/p)``, their tokens in rank-major order); the token-wise code between cannot tell; the row layer takes
them as they are (:func:`rank_major_row_linear`). ParallelMLP's region does the same for its two layers
(``region.keeps_rank_major``). Where the two orders differ, results equal the layers' own to rounding (the GEMMs see
their rows in another order).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..core.collectives import gather_rank_major, sum_partials
from ..core.functional import autocast_inputs, check_linear_inputs
from ..core.graph import differentiable_grads
from ..core.groups import GroupLike, TPGroup, resolve_group
from ..core.seq_order import in_sequence_shape, rank_major_view, reduce_scatter_rank_major
from ..core.wgrad import MainGrads, WeightGradStore, WgradSink, check_main_grads

__all__ = ["rank_major_row_linear"]


class _RowParallelLinearFn(torch.autograd.Function):
    """A row layer under sequence parallelism on an input whose tokens are in rank-major order: its partial sums
    reduce-scattered as they are; backward, the output gradient gathered as it lands. (Named as the layer's own
    Function, ``core.functional``: a backward collective's checks name its site by the autograd node, so a rank
    that runs the layer's own agrees with one that runs this.)"""

    @staticmethod
    def forward(ctx, h, weight, bias, g: TPGroup, sink: WgradSink):
        partial = F.linear(rank_major_view(h, g.size), weight)  # (p, ..., s/p, out): this rank's share, owned
        out = sum_partials(partial, g, True, rank_major=True).wait()  # (..., s/p, out)
        if bias is not None:
            out = out.add_(bias)  # (out is the collective's buffer)
        ctx.save_for_backward(h, weight)
        ctx.g, ctx.sink, ctx.has_bias = g, sink, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):  # (..., s/p, out)
        h, weight = ctx.saved_tensors
        g, need_x, need_w, need_b = ctx.g, *ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():  # create_graph=True: rebuilt from differentiable collectives
            def forward(h, w, b):
                out = reduce_scatter_rank_major(F.linear(h, w), group=g)
                return out if b is None else out + b
            bias = grad_out.new_zeros(grad_out.shape[-1]).requires_grad_() if ctx.has_bias else None
            return (*differentiable_grads(forward, (h, weight, bias), (need_x, need_w, need_b), grad_out), None, None)
        grad_full = gather_rank_major(grad_out, g).wait()  # (p, ..., s/p, out)
        grad_h = in_sequence_shape(grad_full @ weight) if need_x else None  # (..., s, in/p), rank-major like h
        grad_w, grad_b = ctx.sink.linear(grad_full, rank_major_view(h, g.size), need_w, need_b and ctx.has_bias)
        return grad_h, grad_w, grad_b, None, None


def rank_major_row_linear(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                          group: GroupLike, wgrad_store: Optional[WeightGradStore] = None,
                          main_grads: MainGrads = None) -> torch.Tensor:
    """A row-parallel linear under sequence parallelism (``row_parallel_linear(..., sequence_parallel=True)``) whose
    input ``h`` ``(..., s, in/p)`` holds its tokens in rank-major order (``seq_order.in_sequence_shape``: a set's
    outputs kept so, through token-wise code): ``(..., s/p, out)``, this rank's sequence chunk, nothing reordered.
    ``wgrad_store`` / ``main_grads``: as ``row_parallel_linear``'s."""
    g = resolve_group(group)
    check_linear_inputs("row_parallel_linear", h, weight, bias, weight.shape[1], g, True, seq_divisible=True)
    h, weight, bias = autocast_inputs(h, weight, bias)
    sink = WgradSink(g, wgrad_store, check_main_grads(main_grads, weight, bias, "row_parallel_linear", g.size),
                     (weight, bias))
    return _RowParallelLinearFn.apply(h, weight, bias, g, sink)
