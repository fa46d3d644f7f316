"""Siblings share one collective: column layers declared to read one tensor all-reduce their input
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

The set is declared: ``parallelize`` declares the column layers of each region (an attention, an MLP)
as one :class:`Siblings` (a user's own code: :func:`tplayers.declare_siblings`); a column layer no set
declares is the plain Megatron layer. In a forward, the members called on one input form a *call* of
the set: the input is recognised by where its gradient goes (its autograd edge), looked through casts
and FSDP2's post-backward hook, so autocast's cast, FSDP2's per-layer cast of x and a fresh tensor
each layer is handed do not split the set; a member called on something else (a cross-attention's k
and v read the encoder's states) starts a call of its own. In a backward, the call's members that this
backward runs (autograd can say which) add their partials into one buffer; the last of them all-reduces
it under its own weight-gradient GEMM and returns the sum as its input gradient, the others return
none (autograd adds the gradients of every use of ``x``: a residual, a replicated branch, take theirs
directly, so the sum is right whatever else reads ``x``). Weight gradients are each layer's own, returned
as usual (``.grad``, hooks, DDP, ``torch.autograd.grad`` all see the ordinary path). Under sequence
parallelism the call also gathers its input once in forward (kept only while the call lasts) and once in
backward, and reduce-scatters the summed gradient once.

A module whose own code needs the whole sequence (HF attention views q/k/v with its input's (b, s); the
LM head after the last norm) gathers its input itself (`tplayers.core.comm.gather_sequence_for_columns`)
and offers the shard it came from through its model's :class:`ColumnInputs`. Members called on that very
gathered tensor take the sequence-parallel path on the shard (the gathered tensor seeds the call's
forward gather): they save the shard, gather it again in backward and reduce-scatter their summed input
gradient into it, as Megatron's layout does, instead of all-reducing a whole-sequence gradient and
keeping the gathered input alive. Whatever else reads the gathered tensor gets its ordinary (complete)
gradient, split back to the shard.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.autograd.graph import get_gradient_edge

from .collectives import SEQ_DIM, Pending, all_gather, sum_partials
from .groups import TPGroup

__all__ = ["Siblings", "ColumnInputs", "joins_siblings"]

# autograd nodes whose input gradient is their output gradient, element for element (in another dtype): a
# member reached through one reads the set's tensor. FSDP2's node only runs its module's post-backward hook.
_SEE_THROUGH = {"ToCopyBackward0": False, "RegisterPostBackwardFunctionBackward": True}  # name -> one edge per output


def _source(x: torch.Tensor) -> Tuple[Any, int]:
    """Where ``x``'s gradient goes, looked through casts and FSDP2's post-backward hook: the autograd edge
    every member called on ``x`` (or on a cast of it) shares."""
    edge = get_gradient_edge(x)
    node, nr = edge.node, edge.output_nr
    while node is not None and node.name() in _SEE_THROUGH:
        node, nr = node.next_functions[nr if _SEE_THROUGH[node.name()] else 0]
    return node, nr


class ColumnInputs:
    """What one model's forward has in flight for its column layers: the call of a set of siblings being
    made (one at a time: a new call closes the last, so a forward without backward keeps no input alive
    beyond it), and the last sequence a module gathered for them (:func:`gather_sequence_for_columns`)
    with the shard it came from (held only while the gathered tensor lives). ``parallelize`` makes one per
    model; a copied or pickled model starts with nothing in flight."""

    __slots__ = ("call", "_offer", "__weakref__")

    def __init__(self) -> None:
        self.call: Optional[_Call] = None
        self._offer: Optional[Tuple[Any, torch.Tensor, TPGroup]] = None

    def offer(self, x_full: torch.Tensor, x_shard: torch.Tensor, g: TPGroup) -> None:
        """``x_full`` is ``x_shard`` gathered along the sequence over ``g``; a later offer replaces it."""
        offer = self._offer = (weakref.ref(x_full), x_shard, g)
        weakref.finalize(x_full, _withdraw, weakref.ref(self), offer)

    def take(self, x: torch.Tensor, g: TPGroup) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(shard, gathered)`` when ``x`` is the tensor last offered over ``g``, or a view of all of it
        (HF causal LMs call their head on ``hidden_states[:, slice(0, None), :]``), else None."""
        offer = self._offer
        full = offer[0]() if offer is not None and offer[2] == g else None
        if full is None or not (x is full or (x._base is full and x.shape == full.shape and x.stride() == full.stride()
                                              and x.storage_offset() == full.storage_offset())):
            return None
        return offer[1], x

    def close(self) -> None:
        """The call in flight takes no more members (its inputs are let go; a backward still runs it)."""
        call, self.call = self.call, None
        if call is not None:
            call.x = call.x_full = call.x_cast = None

    def __getstate__(self) -> Dict[str, Any]:
        return {}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.call = self._offer = None


def _withdraw(slot: "weakref.ref[ColumnInputs]", offer: tuple) -> None:
    owner = slot()
    if owner is not None and owner._offer is offer:
        owner._offer = None


class Siblings:
    """A declared set of column layers that read one tensor (q/k/v, gate/up): their input gradient is
    summed and reduced once per call. ``inputs``: the model's :class:`ColumnInputs` (its own if None)."""

    __slots__ = ("inputs",)

    def __init__(self, inputs: Optional[ColumnInputs] = None) -> None:
        self.inputs = ColumnInputs() if inputs is None else inputs

    def join(self, x: torch.Tensor, g: TPGroup, weight: torch.Tensor, sequence_parallel: bool,
             dtype: Optional[torch.dtype], offered: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
             ) -> Tuple["_Call", torch.Tensor]:
        """The call a member with ``weight`` joins on ``x`` (the model's call in flight when it is this set's, on
        ``x`` or a cast of it: the same source; else a new one) and ``x`` as the call computes on it: cast once to
        autocast's ``dtype`` (None: off). ``offered``: ``(shard, gathered)`` when ``x`` is the shard of a sequence
        its module gathered (:meth:`ColumnInputs.take`): the gathered tensor is the call's forward gather."""
        call, source = self.inputs.call, _source(x)
        if (call is None or call.owner is not self or call.source != source or call.g != g
                or call.sp != sequence_parallel or call.x.dtype != x.dtype or call.x.shape != x.shape
                or call.x.device != x.device or id(weight) in call.weights):
            self.inputs.close()
            call = self.inputs.call = _Call(self, x, source, g, sequence_parallel)
        call.weights.append(id(weight))
        x = call.cast(x, dtype)
        if offered is not None and call.x_full is None:
            call.x_full = offered[1].to(x.dtype)  # (cast as x is under autocast)
        return call, x


class _Call:
    """One call of a set: the members called on one input, their autograd nodes, the gathered input they
    share in forward (sequence parallelism), and per backward the partial sum so far."""

    __slots__ = ("owner", "x", "source", "g", "sp", "nodes", "weights", "tasks", "x_full", "x_cast")

    def __init__(self, owner: Siblings, x: torch.Tensor, source: Tuple[Any, int], g: TPGroup,
                 sequence_parallel: bool) -> None:
        self.owner, self.x, self.source, self.g, self.sp = owner, x, source, g, sequence_parallel
        self.nodes: List[Any] = []  # weak references to the members' autograd nodes
        self.weights: List[int] = []  # ids of the members' weights: a layer joins a call once
        self.tasks: Dict[int, List[Any]] = {}  # graph task -> [partial sum, members still to run, gathered x]
        self.x_full: Optional[torch.Tensor] = None  # SP: the all-gathered x, shared by the forwards only
        self.x_cast: Optional[torch.Tensor] = None  # x as autocast casts it: one cast (one tensor) for the call

    def register(self, node: Any) -> None:
        """A member's autograd node (its Function's ``ctx``), so a backward can count the members it runs."""
        self.nodes.append(weakref.ref(node))

    def cast(self, x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
        """``x`` cast to autocast's ``dtype`` (None: autocast off), once for the members called on the call's
        own tensor: they compute on one tensor, whose one gradient (the sum) flows back through one cast."""
        if dtype is None or x.dtype == dtype:
            return x
        if x is not self.x:
            return x.to(dtype)  # (a member handed its own copy: the same values, cast for it alone)
        if self.x_cast is None or self.x_cast.dtype != dtype:
            self.x_cast = x.to(dtype)
        return self.x_cast

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Forward, sequence parallelism: every rank's chunk of ``x``, gathered once for the call."""
        if self.x_full is None:
            self.x_full = all_gather(x, SEQ_DIM, self.g).wait()
        return self.x_full

    def _state(self) -> List[Any]:
        task = torch._C._current_graph_task_id()
        state = self.tasks.get(task)
        if state is None:
            if self.owner.inputs.call is self:  # no member joins once its backward began
                self.owner.inputs.close()
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

    def add(self, partial: torch.Tensor) -> Optional[torch.Tensor]:
        """Add this member's part of the input gradient (a buffer it owns; `tplayers.core.invariant`: its leaves'
        products); the last member of this backward gets the sum, in the members' backward order; the others None."""
        state = self._state()
        state[0] = partial if state[0] is None else state[0].add_(partial)
        state[1] -= 1
        if state[1] > 0:
            return None
        del self.tasks[torch._C._current_graph_task_id()]
        return state[0]

    def add_partial(self, partial: torch.Tensor, overlap: bool) -> Optional[Pending]:
        """Add this member's partial input gradient (a buffer it owns); the last member of this backward
        gets the all-reduce (SP: reduce-scatter) of the sum, launched; the others None."""
        total = self.add(partial)
        return None if total is None else sum_partials(total, self.g, self.sp, async_op=overlap)


def joins_siblings(siblings: Optional[Siblings], x: torch.Tensor, g: TPGroup, collective_matmul: bool,
                   invariant: bool = False) -> bool:
    """Whether a column layer's call joins its declared set: a backward to come, at TP > 1 (``invariant``, the
    fixed tree: at TP 1 too, whose sum has the same structure), eager, not as ring steps (collective matmul
    gathers chunk by chunk under its own GEMMs)."""
    return (siblings is not None and (g.size > 1 or invariant) and not collective_matmul and x.requires_grad
            and torch.is_grad_enabled() and not torch.compiler.is_compiling())
