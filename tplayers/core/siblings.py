"""Siblings share one collective: column layers that consume the same tensor all-reduce their input
gradient once.

A Hugging Face attention calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` on the same ``x`` (an MLP:
``gate_proj(x)``, ``up_proj(x)``). Each column layer's input gradient is a partial sum over ranks; on
its own each all-reduces it (3 collectives for q/k/v). Megatron fuses the weights so that one
all-reduce follows the sum of the three partials. Here, without fusing::

    Before (one all-reduce per sibling)       Now (one for the set)
    v: grad_x_v = grad_v @ Wv; all_reduce     v: acc  = grad_v @ Wv;  grad_Wv           (autograd runs v, k, q)
       grad_Wv (under it); wait                k: acc += grad_k @ Wk;  grad_Wk
    k: the same                               q: acc += grad_q @ Wq;  pending = all_reduce(acc)
    q: the same                                  grad_Wq (under it); grad_x = pending.wait()

The set is found at run time: a column layer whose input is the very tensor the previous column layer
consumed (same object, same group, a layer not yet in the set, before any backward of the set) joins
it. In a backward, the set's layers that this backward runs (autograd can say which) add their
partials into one buffer; the last of them all-reduces it under its own weight-gradient GEMM and
returns the sum as its input gradient, the others return none (autograd adds the gradients of every
use of ``x``: a residual, a replicated branch, take theirs directly, so the sum is right whatever else
reads ``x``). Weight gradients are each layer's own, returned as usual (``.grad``, hooks, DDP,
``torch.autograd.grad`` all see the ordinary path). Under sequence parallelism the set also gathers
its input once in forward (kept only while the set is being called) and once in backward, and
reduce-scatters the summed gradient once.

A module whose own code needs the whole sequence (HF attention views q/k/v with its input's (b, s); the
LM head after the last norm) gathers its input itself (`tplayers.core.comm.gather_sequence_for_columns`)
and offers the shard it came from. Column layers called on that very gathered tensor take the
sequence-parallel path on the shard (the gathered tensor seeds the set's forward gather): they save the
shard, gather it again in backward and reduce-scatter their summed input gradient into it, as Megatron's
layout does, instead of all-reducing a whole-sequence gradient and keeping the gathered input alive.
Whatever else reads the gathered tensor gets its ordinary (complete) gradient, split back to the shard.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from .collectives import SEQ_DIM, Pending, all_gather, sum_partials
from .groups import TPGroup

__all__ = ["Siblings", "join_siblings", "joins_siblings", "register", "offer_shard", "take_shard"]


class Siblings:
    """Column layers on one input: their autograd nodes, the gathered input they share in forward
    (sequence parallelism), and per backward the partial sum so far."""

    __slots__ = ("x", "g", "sp", "nodes", "weights", "tasks", "backward_started", "x_full", "x_cast")

    def __init__(self, x: torch.Tensor, g: TPGroup, sequence_parallel: bool) -> None:
        self.x, self.g, self.sp = x, g, sequence_parallel
        self.nodes: List[Any] = []  # weak references to the members' autograd nodes
        self.weights: List[int] = []  # ids of the members' weights: a layer joins a set once
        self.tasks: Dict[int, List[Any]] = {}  # graph task -> [partial sum, members still to run, gathered x]
        self.backward_started = False
        self.x_full: Optional[torch.Tensor] = None  # SP: the all-gathered x, shared by the forwards only
        self.x_cast: Optional[torch.Tensor] = None  # x as autocast casts it: one cast (one tensor) for the set

    def cast(self, x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
        """``x`` (the set's input) cast to autocast's ``dtype`` (None: autocast off) once for the set: every
        member computes on the same tensor, whose one gradient (the sum) flows back through one cast."""
        if dtype is None or x.dtype == dtype:
            return x
        if self.x_cast is None or self.x_cast.dtype != dtype:
            self.x_cast = x.to(dtype)
        return self.x_cast

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Forward, sequence parallelism: every rank's chunk of ``x``, gathered once for the set."""
        if self.x_full is None:
            self.x_full = all_gather(x, SEQ_DIM, self.g).wait()
        return self.x_full

    def _state(self) -> List[Any]:
        task = torch._C._current_graph_task_id()
        state = self.tasks.get(task)
        if state is None:
            self.backward_started, self.x_full, self.x_cast = True, None, None
            if _LAST[0] is self:
                _LAST[0] = None
            running = sum(1 for ref in self.nodes if (n := ref()) is not None and torch._C._will_engine_execute_node(n))
            state = self.tasks[task] = [None, running, None]
        return state

    def gathered_input(self, x: torch.Tensor, overlap: bool) -> Pending:
        """Backward, sequence parallelism: the gather of ``x`` the members' weight gradients multiply,
        launched once per backward (in flight under the first member's input-gradient GEMM)."""
        state = self._state()
        if state[2] is None:
            state[2] = all_gather(x, SEQ_DIM, self.g, async_op=overlap)
        return state[2]

    def add_partial(self, partial: torch.Tensor, overlap: bool) -> Optional[Pending]:
        """Add this member's partial input gradient (a buffer it owns); the last member of this backward
        gets the all-reduce (SP: reduce-scatter) of the sum, launched; the others None."""
        state = self._state()
        state[0] = partial if state[0] is None else state[0].add_(partial)
        state[1] -= 1
        if state[1] > 0:
            return None
        del self.tasks[torch._C._current_graph_task_id()]
        return sum_partials(state[0], self.g, self.sp, async_op=overlap)


_LAST: list = [None]  # the set the last column layer joined (None once its backward began)


_OFFERED: list = [None]  # (weak reference to the gathered tensor, its shard, group): the last offer


def offer_shard(x_full: torch.Tensor, x_shard: torch.Tensor, g: TPGroup) -> None:
    """``x_full`` is ``x_shard`` gathered along the sequence over ``g``: column layers called on ``x_full``
    may take the sequence-parallel path on ``x_shard`` (:func:`take_shard`). One offer at a time (a later
    one replaces it); it holds the shard (often nothing else does: a norm's output replaced by its gather)
    only while ``x_full`` lives."""
    offer = _OFFERED[0] = (weakref.ref(x_full), x_shard, g)
    weakref.finalize(x_full, _withdraw, offer)


def _withdraw(offer: tuple) -> None:
    if _OFFERED[0] is offer:
        _OFFERED[0] = None


def take_shard(x: torch.Tensor, g: TPGroup) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``(shard, gathered)`` when ``x`` is the tensor last offered over ``g``, or a view of all of it
    (HF causal LMs call their head on ``hidden_states[:, slice(0, None), :]``), else None."""
    offer = _OFFERED[0]
    full = offer[0]() if offer is not None and offer[2] == g else None
    if full is None or not (x is full or (x._base is full and x.shape == full.shape and x.stride() == full.stride()
                                          and x.storage_offset() == full.storage_offset())):
        return None
    return offer[1], x


def join_siblings(x: torch.Tensor, g: TPGroup, weight: torch.Tensor, sequence_parallel: bool) -> Siblings:
    """The set of column layers on ``x`` that a layer with ``weight`` joins (a new one when ``x`` is not the
    last set's input). The layer's autograd Function registers its node with :func:`register` in forward."""
    siblings = _LAST[0]
    if (siblings is None or siblings.backward_started or siblings.x is not x or siblings.g != g
            or siblings.sp != sequence_parallel or id(weight) in siblings.weights):
        if siblings is not None:  # (the gathered, cast input lives only while its set is being called)
            siblings.x_full = siblings.x_cast = None
        siblings = _LAST[0] = Siblings(x, g, sequence_parallel)
    siblings.weights.append(id(weight))
    return siblings


def joins_siblings(x: torch.Tensor, g: TPGroup, collective_matmul: bool) -> bool:
    """Whether a column layer's call joins a set of siblings: a backward to come, at TP > 1, eager, not
    as ring steps (collective matmul gathers chunk by chunk under its own GEMMs)."""
    return (g.size > 1 and not collective_matmul and x.requires_grad and torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def register(siblings: Siblings, node: Any) -> None:
    """A member's autograd node (its Function's ``ctx``), so a backward can count the members it runs."""
    siblings.nodes.append(weakref.ref(node))
