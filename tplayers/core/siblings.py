"""Siblings share one collective: column layers declared to read one tensor all-reduce their input
gradient once, with every member's weight-gradient GEMM under it.

A Hugging Face attention calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` on the same ``x`` (an MLP:
``gate_proj(x)``, ``up_proj(x)``). Each column layer's input gradient is a partial sum over ranks; on
its own each all-reduces it (3 collectives for q/k/v). Megatron fuses the weights so that one
all-reduce follows the sum of the three partials, under one weight-gradient GEMM. Here, without fusing::

    Before (one all-reduce per sibling)       Now (one for the set, at its entry)
    v: grad_x_v = grad_v @ Wv; all_reduce     v: grad_v @ Wv  -> the entry's input gradient (autograd adds)
       grad_Wv (under it); wait                k: grad_k @ Wk  -> added
    k: the same                               q: grad_q @ Wq  -> added
    q: the same                               entry: all_reduce(the sum); grad_Wv, grad_Wk, grad_Wq (under it); wait

The set is declared: ``parallelize`` declares the column layers of each region as one :class:`Siblings`
(a user's own code: :func:`tplayers.declare_siblings`); a column layer no set declares is the plain Megatron
layer. In a forward, the members called on one input form a *call* of the set: the input is recognised by
where its gradient goes (its autograd edge), looked through casts and FSDP2's post-backward hook, so
autocast's cast, FSDP2's per-layer cast of x and a fresh tensor each layer is handed do not split the set; a
member called on something else (a cross-attention's k and v read the encoder's states) starts a call of its
own. The call's first member applies its *entry* (f, `tplayers.core.functional`): an autograd Function that
takes x (cast once under autocast; under sequence parallelism it gathers the sequence, once) and the members'
weights, and hands the members x and views of those weights to compute on. Because every member computes on
the entry's outputs, autograd runs the entry's backward once all members this backward reaches have run,
with their partial input gradients already added (no counting): it launches the one all-reduce (SP:
reduce-scatter), runs the weight-gradient GEMMs the members left it under it, waits, and returns the input
gradient and the weights' gradients through autograd (``.grad``, hooks, DDP, FSDP2, ``main_grad`` buffers see
the ordinary path). Whatever else reads ``x`` (a residual, a replicated branch) gets its gradient directly.
A member whose weight the entry did not take computes its own weight gradient (a weight FSDP2 keeps sharded
until the member's own pre-forward, a weight read through a function, delay_wgrad's recorded GEMMs):
:meth:`Siblings.entry_weights`. Each member also takes the tensor it was called on as an input (no gradient:
the entry's carries it), so what hooks that tensor (FSDP2's post-backward of a member wrapped on its own) runs
right after that member.

A module whose own code needs the whole sequence (HF attention views q/k/v with its input's (b, s); the
LM head after the last norm) gathers its input itself (`tplayers.core.comm.gather_sequence_for_columns`)
and offers the shard it came from through its model's :class:`ColumnInputs`. Members called on that very
gathered tensor take the sequence-parallel path on the shard (the gathered tensor is the entry's forward
gather): the entry saves the shard, gathers it again in backward and reduce-scatters the summed input
gradient into it, as Megatron's layout does, instead of all-reducing a whole-sequence gradient and
keeping the gathered input alive. Whatever else reads the gathered tensor gets its ordinary (complete)
gradient, split back to the shard.

Under sequence parallelism with a batch (b > 1) the sequence's order interleaves the ranks' chunks with the batch,
so re-gathering the input for the weight gradients and reduce-scattering the summed input gradient each copied the
whole input. A set whose members are narrower together than twice its input (q/k/v, gate/up at TP 8) runs its
backward in the collectives' own rank-major order instead (:mod:`.seq_order`): each member reorders its output
gradient, hands the entry its partial in that order (a gradient only the entry reads), and the gather and the
reduce-scatter copy nothing (:meth:`Siblings.backward_rank_major`, one choice per set).

A set can be told to keep its next call's outputs in that rank-major order too (:meth:`ColumnInputs.keep_rank_major`:
a Hugging Face gated MLP, whose ``act_fn(gate) * up`` is token-wise, hands them to its down projection as they are,
``tplayers.regions.gated``): the forward gather is not reordered, nor are the members' output gradients.

Inside a torch.compile graph the set does not share (each layer reduces its own: the entry keeps Python state
per backward that a traced graph cannot). Under ``tp_invariant`` (:mod:`.invariant`) the entry's backward
receives the members' leaf products, added leaf by leaf by autograd, and sums them as the fixed tree (the
members compute their own weight gradients).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import get_gradient_edge
from torch.distributed.tensor import DTensor

from .collectives import Pending
from .groups import TPGroup
from .seq_order import gather_sequence, in_sequence_shape

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

    __slots__ = ("call", "_offer", "kept", "__weakref__")

    def __init__(self) -> None:
        self.call: Optional[_Call] = None
        self._offer: Optional[Tuple[Any, torch.Tensor, TPGroup, bool]] = None
        self.kept: Optional[Siblings] = None  # the set whose next call keeps its outputs rank-major (SP)

    @contextlib.contextmanager
    def keep_rank_major(self, siblings: "Siblings") -> Iterator["ColumnInputs"]:
        """Within: a call of ``siblings`` made under sequence parallelism (a backward to come, on a shard no module
        gathered) keeps its tokens in rank-major order, its members' outputs ``(..., s, out/p)`` in that order
        (``seq_order.in_sequence_shape``); whoever reads them must take that order (:attr:`_Call.kept`)."""
        self.close()
        self.kept = siblings
        try:
            yield self
        finally:
            self.kept = None

    def offer(self, x_full: torch.Tensor, x_shard: torch.Tensor, g: TPGroup, rank_major: bool = False) -> None:
        """``x_full`` is ``x_shard`` gathered along the sequence over ``g`` (``rank_major``: its tokens in that order,
        ``seq_order.in_sequence_shape``); a later offer replaces it."""
        offer = self._offer = (weakref.ref(x_full), x_shard, g, rank_major)
        weakref.finalize(x_full, _withdraw, weakref.ref(self), offer)

    def take(self, x: torch.Tensor, g: TPGroup) -> Optional[Tuple[torch.Tensor, torch.Tensor, bool]]:
        """``(shard, gathered, rank_major)`` when ``x`` is the tensor last offered over ``g``, or a view of all of it
        (HF causal LMs call their head on ``hidden_states[:, slice(0, None), :]``), else None."""
        offer = self._offer
        full = offer[0]() if offer is not None and offer[2] == g else None
        if full is None or not (x is full or (x._base is full and x.shape == full.shape and x.stride() == full.stride()
                                              and x.storage_offset() == full.storage_offset())):
            return None
        return offer[1], x, offer[3]

    def close(self) -> None:
        """The call in flight takes no more members (its inputs are let go; a backward still runs it)."""
        call, self.call = self.call, None
        if call is not None:
            call.x = call.x_full = call.x_cast = call.token = None
            call.taken, call.views = [], []

    def __getstate__(self) -> Dict[str, Any]:
        return {}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.call = self._offer = self.kept = None


def _withdraw(slot: "weakref.ref[ColumnInputs]", offer: tuple) -> None:
    owner = slot()
    if owner is not None and owner._offer is offer:
        owner._offer = None


class Siblings:
    """A declared set of column layers that read one tensor (q/k/v, gate/up): their input gradient is
    summed and reduced once per call. ``inputs``: the model's :class:`ColumnInputs` (its own if None);
    ``members``: the layers (their weights enter a call's entry, :meth:`entry_weights`)."""

    __slots__ = ("inputs", "members")

    def __init__(self, inputs: Optional[ColumnInputs] = None, members: Sequence[torch.nn.Module] = ()) -> None:
        self.inputs = ColumnInputs() if inputs is None else inputs
        self.members = tuple(members)

    def join(self, x: torch.Tensor, g: TPGroup, weight: torch.Tensor, sequence_parallel: bool,
             dtype: Optional[torch.dtype], offered: Optional[Tuple[torch.Tensor, torch.Tensor, bool]] = None,
             may_reorder: bool = True) -> Tuple["_Call", torch.Tensor]:
        """The call a member with ``weight`` joins on ``x`` (the model's call in flight when it is this set's, on
        ``x`` or a cast of it: the same source; else a new one) and ``x`` as the call computes on it: cast once to
        autocast's ``dtype`` (None: off). ``offered``: ``(shard, gathered)`` when ``x`` is the shard of a sequence
        its module gathered (:meth:`ColumnInputs.take`): the gathered tensor is the call's forward gather.
        ``may_reorder``: the call's backward may run rank-major (:meth:`backward_rank_major`; tp_invariant's
        fixed tree keeps the sequence's order)."""
        call, source = self.inputs.call, _source(x)
        if (call is None or call.owner is not self or call.source != source or call.g != g
                or call.sp != sequence_parallel or call.x.dtype != x.dtype or call.x.shape != x.shape
                or call.x.device != x.device or id(weight) in call.weights):
            self.inputs.close()
            kept = sequence_parallel and may_reorder and offered is None and self.inputs.kept is self
            call = self.inputs.call = _Call(self, x, source, g, sequence_parallel, kept or (
                sequence_parallel and may_reorder and self.backward_rank_major(x.shape[-1])), kept)
        call.weights.append(id(weight))
        x = call.cast(x, dtype)
        if offered is not None and call.x_full is None:
            call.x_full = offered[1].to(x.dtype)  # (cast as x is under autocast)
            call.sorts = offered[2]  # (rank-major: the members put their outputs in the sequence's order)
        return call, x

    def backward_rank_major(self, in_features: int) -> bool:
        """Under sequence parallelism, whether a call's backward runs its GEMMs in rank-major token order
        (:mod:`.seq_order`): one reorder of every member's output gradient (the declared members' ``out/p``
        together) against two of the whole input (the re-gathered input, the summed input gradient). A set of the
        declared members, fixed per set: every member of a call, and every rank, takes the same order."""
        width = sum(m.weight.shape[0] for m in self.members if isinstance(getattr(m, "weight", None), torch.Tensor))
        return 0 < width < 2 * in_features

    def entry_weights(self) -> List[torch.Tensor]:
        """The members' weights a call's entry takes at its start, so that their weight-gradient GEMMs run under
        its collective: each member's ``weight`` now, unless it is a DTensor (FSDP2 wrapping a member on its own
        shards it until that member's pre-forward: only the first member called has its weight whole; that
        member's post-backward hook, at the entry's input, runs after the entry). A member that multiplies
        another tensor (a weight read through a function, a cast) computes its own."""
        return [m.weight for m in self.members if isinstance(m.weight, torch.Tensor) and not isinstance(m.weight, DTensor)]


class _Call:
    """One call of a set: the members called on one input; its entry's outputs (the input the members compute
    on, views of the weights it took); the gathered input they share in forward (sequence parallelism); per
    backward, the weight-gradient GEMMs the members left the entry and the gather of the input they share."""

    __slots__ = ("owner", "x", "source", "g", "sp", "rank_major", "kept", "sorts", "weights", "tasks", "x_full",
                 "x_cast", "token", "taken", "views", "overlap")

    def __init__(self, owner: Siblings, x: torch.Tensor, source: Tuple[Any, int], g: TPGroup,
                 sequence_parallel: bool, rank_major: bool = False, kept: bool = False) -> None:
        self.owner, self.x, self.source, self.g, self.sp = owner, x, source, g, sequence_parallel
        self.rank_major = rank_major  # SP: the backward's token order (Siblings.backward_rank_major)
        self.kept = kept  # SP: the forward's too, the members' outputs left in it (ColumnInputs.keep_rank_major)
        self.sorts = False  # SP: the forward's input offered rank-major, the members' outputs put in sequence order
        self.weights: List[int] = []  # ids of the members' weights: a layer joins a call once
        self.tasks: Dict[int, Dict[str, Any]] = {}  # graph task -> what its members left the entry (_mailbox)
        self.x_full: Optional[torch.Tensor] = None  # SP: the all-gathered x, shared by the forwards only
        self.x_cast: Optional[torch.Tensor] = None  # x as autocast casts it: one cast (one tensor) for the call
        self.token: Optional[torch.Tensor] = None  # the entry's output: the input every member computes on
        self.taken: List[torch.Tensor] = []  # the weights the entry took (for the forward only)
        self.views: List[torch.Tensor] = []  # the entry's views of them, in that order (tp_invariant: its leaves)
        self.overlap = True

    def enter(self, outputs: Sequence[torch.Tensor], overlap: bool, taken: Sequence[torch.Tensor]) -> None:
        """The entry's outputs ``(token, *views of taken)``; ``overlap``: its collective async under the GEMMs."""
        self.token, self.views, self.taken, self.overlap = outputs[0], list(outputs[1:]), list(taken), overlap

    def view_of(self, weight: torch.Tensor) -> Tuple[Optional[int], torch.Tensor]:
        """``(i, the entry's view)`` when the entry took ``weight`` (the i-th), else ``(None, weight)``."""
        for i, taken in enumerate(self.taken):
            if taken is weight:
                return i, self.views[i]
        return None, weight

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
        if self.x_full is None:  # (kept: rank-major, in the sequence's shape)
            self.x_full = self.regather(x)
        return self.x_full

    def regather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's chunk of ``x`` in the call's forward order (its forward gather; create_graph's rebuild)."""
        full = gather_sequence(x, self.g, self.kept).wait()
        return in_sequence_shape(full) if self.kept else full

    def _mailbox(self) -> Dict[str, Any]:
        task = torch._C._current_graph_task_id()
        return self.tasks.setdefault(task, {"left": [], "gather": None})  # (dropped by the entry's backward)

    def gathered_input(self, x: torch.Tensor, overlap: bool) -> Pending:
        """Backward, sequence parallelism: the gather of ``x`` the weight gradients multiply (in the backward's token
        order), launched once per backward by the first that needs it (in flight under the GEMMs that follow)."""
        box = self._mailbox()
        if box["gather"] is None:
            box["gather"] = gather_sequence(x, self.g, self.rank_major, async_op=overlap)
        return box["gather"]

    def leave(self, index: int, grad_out: torch.Tensor, main: Optional[Any]) -> None:
        """A member's weight-gradient GEMM for the entry's ``index``-th weight (``main``: its main_grad buffer)."""
        self._mailbox()["left"].append((index, grad_out, main))

    def take_left(self) -> Dict[str, Any]:
        """The entry's backward: what the members this backward ran left it (and the shared gather)."""
        return self.tasks.pop(torch._C._current_graph_task_id(), {"left": [], "gather": None})

    def began(self) -> None:
        """A backward through this call began: no member joins it any more."""
        if self.owner.inputs.call is self:
            self.owner.inputs.close()


def joins_siblings(siblings: Optional[Siblings], x: torch.Tensor, g: TPGroup, collective_matmul: bool,
                   invariant: bool = False) -> bool:
    """Whether a column layer's call joins its declared set: a backward to come, at TP > 1 (``invariant``, the
    fixed tree: at TP 1 too, whose sum has the same structure), eager, not as ring steps (collective matmul
    gathers chunk by chunk under its own GEMMs)."""
    return (siblings is not None and (g.size > 1 or invariant) and not collective_matmul and x.requires_grad
            and torch.is_grad_enabled() and not torch.compiler.is_compiling())
