"""Siblings share one collective: column layers that consume the same tensor all-reduce their input
gradient once.

A Hugging Face attention calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` on the same ``x`` (an MLP:
``gate_proj(x)``, ``up_proj(x)``). Each column layer's input gradient is a partial sum over ranks; on
its own each all-reduces it (3 collectives for q/k/v). Megatron fuses the weights so that autograd
adds the three partials first and one all-reduce follows::

    Before (one f per sibling)                Now (one f for the siblings)
    grad_x_q = grad_q @ Wq; all_reduce        grad_x = grad_q @ Wq + grad_k @ Wk + grad_v @ Wv  (autograd adds)
    grad_x_k = grad_k @ Wk; all_reduce        pending = all_reduce(grad_x, async_op=True)      (one f)
    grad_x_v = grad_v @ Wv; all_reduce        grad_Wq, grad_Wk, grad_Wv                         (under it)
    (each under its own weight-gradient GEMM) grad_x = pending.wait()

The siblings are found at run time: a column layer whose input is the very tensor the previous
column layer consumed (same object, same group, a layer not yet in the set) joins its set. The set's
``x`` passes once through `_SharedInput` (f: identity forward), each sibling returns its partial input
gradient and records its weight-gradient GEMMs; f's backward launches the all-reduce, runs the GEMMs
under it, waits. Other uses of ``x`` (a residual, a replicated branch) take their gradient directly,
outside f, so the sum stays right whatever else consumes ``x``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .collectives import all_reduce, owned_copy
from .groups import TPGroup
from .wgrad import WeightGradStore

__all__ = ["shared_input", "joins_siblings", "accumulated_now"]


class _Siblings:
    """One set of column layers on the same input: f's output, their recorded weight gradients."""

    __slots__ = ("x", "g", "shared", "store", "members", "closed")

    def __init__(self, x: torch.Tensor, g: TPGroup) -> None:
        self.x, self.g, self.store, self.members, self.closed = x, g, WeightGradStore(), set(), False
        self.shared: Optional[torch.Tensor] = None


_LAST: list = [None]  # the set the last column layer joined (None after its backward ran)


class _SharedInput(torch.autograd.Function):
    """f once for a set of siblings: identity forward; backward all-reduces the summed partials, with
    the siblings' weight-gradient GEMMs under the collective."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, siblings: _Siblings) -> torch.Tensor:
        ctx.siblings = siblings
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # (..., in): every sibling's partial, added by autograd
        siblings = ctx.siblings
        siblings.closed = True
        if _LAST[0] is siblings:
            _LAST[0] = None
        if torch.is_grad_enabled():  # create_graph=True: the siblings' rebuilt backward recorded nothing
            from .comm import reduce_from_tp

            return reduce_from_tp(grad, group=siblings.g), None
        pending = all_reduce(owned_copy(grad), siblings.g, async_op=True)
        siblings.store.flush()  # the weight-gradient GEMMs, while the all-reduce travels
        return pending.wait(), None


def shared_input(x: torch.Tensor, g: TPGroup, member: torch.Tensor) -> Tuple[torch.Tensor, WeightGradStore]:
    """``x`` through the f its column-layer siblings share (``member``: this layer's weight, naming it
    in the set), and the store its weight gradients go to."""
    siblings = _LAST[0]
    if (siblings is None or siblings.closed or siblings.x is not x or siblings.g != g
            or id(member) in siblings.members):
        siblings = _Siblings(x, g)
        siblings.shared = _SharedInput.apply(x, siblings)
        _LAST[0] = siblings
    siblings.members.add(id(member))
    return siblings.shared, siblings.store


def joins_siblings(x: torch.Tensor, g: TPGroup, sequence_parallel: bool, overlap_comm: bool,
                   collective_matmul: bool) -> bool:
    """Whether a column layer's call joins a set of siblings: a backward to come, at TP > 1, without
    sequence parallelism (its gather is shared another way), in the overlapped eager mode."""
    return (g.size > 1 and not sequence_parallel and overlap_comm and not collective_matmul and x.requires_grad
            and torch.is_grad_enabled() and not torch.compiler.is_compiling())



def accumulated_now(ctx: object, need_w: bool, need_b: bool) -> bool:
    """Whether a sibling's weight (and bias) gradients may wait for its set's f: only where this backward
    accumulates them into ``.grad`` (the parameters' AccumulateGrad nodes run in it), which the
    recorded GEMMs then do; under ``torch.autograd.grad(..., inputs=[w])`` the gradient must come back
    from the layer's own backward, so it is computed there (the collective then travels alone)."""
    nodes = ctx.next_functions  # per forward input: (x, weight, bias, ...)
    for index, need in ((1, need_w), (2, need_b)):
        if not need:
            continue
        node = nodes[index][0]
        if node is None or type(node).__name__ != "AccumulateGrad":
            return False
        try:
            if not torch._C._will_engine_execute_node(node):
                return False
        except RuntimeError:  # torch refuses the question for a leaf inside torch.autograd.grad(): not .backward()
            return False
    return need_w or need_b
