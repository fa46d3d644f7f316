"""Replicated parameters with partial gradients, summed by one all-reduce per forward.

A norm inside a sequence-parallel region runs on this rank's tokens only, so each rank's gradient of
its (replicated) weight is a partial sum; Qwen3's per-head ``q_norm`` after a column split sees only
this rank's heads. Each such parameter used to enter its module's forward through its own
``copy_to_tp`` (identity forward, all-reduce of the gradient backward): one tiny all-reduce per norm,
2 per decoder layer, each a full collective's latency. Megatron sums them after backward with one
coalesced all-reduce. Here they are summed inside autograd, so ``.grad``, ``torch.autograd.grad``,
hooks and DDP see complete gradients as before::

    Before (one all-reduce per module)        Now (one per forward)
    norm_i: w_i' = copy_to_tp(w_i)            first use in a forward: (w_1', ..., w_n') =
    backward: all_reduce(grad w_i), n times       copy_many_to_tp(w_1, ..., w_n)  (every registered one)
                                              norm_i reads w_i'
                                              backward: the node runs once every norm's backward has:
                                                one all-reduce of [grad w_1, ..., grad w_n]

With ``holders`` the parameters are replicated over runs of ranks instead (a replicated KV head's
``k_proj`` and ``v_proj`` weights and biases): the one collective sums over the ranks holding the same
replica (`tplayers.core.comm.copy_many_to_replicas`), k and v together.

A set is used once per parameter: a module called a second time in a forward, a second forward
before the backward, or a parameter changed in place since the set was made, starts a new set (its own all-reduce; each set sums exactly what reached it, so
any order is right). Inside a backward (activation checkpointing's recomputation) each parameter goes
through its own ``copy_to_tp`` (reentrant checkpointing backpropagates through that recomputed graph).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..core.comm import copy_many_to_replicas, copy_many_to_tp, copy_to_tp, sum_over_replicas
from ..core.groups import TPGroup

__all__ = ["PartialGradSum"]


class PartialGradSum:
    """A set of replicated parameters with partial gradients over one TP group, summed together: one per
    ``parallelize`` call (its norms, per-head parameters), one per attention with replicated KV heads (its k
    and v, ``holders`` their replica layout)."""

    def __init__(self, group: TPGroup, holders: Optional[Sequence[int]] = None) -> None:
        self.group = group
        self.holders = None if holders is None else tuple(int(n) for n in holders)
        self.members: List[Tuple[nn.Module, str]] = []  # (module, parameter name), in registration order
        self._unused: Dict[int, Tuple[torch.Tensor, int]] = {}  # id(parameter) -> (its view in the current set,
        # the parameter's version then), until read

    def register(self, module: nn.Module, names: Tuple[str, ...]) -> None:
        self.members.extend((module, n) for n in names)

    def read(self, param: torch.Tensor) -> torch.Tensor:
        """What a module reads for ``param`` in this forward (a parameter registered here)."""
        if self.group.size == 1 or not param.requires_grad or not torch.is_grad_enabled():
            return param
        if torch._C._current_graph_task_id() != -1:  # a recomputation inside backward
            return self._one(param)
        view, version = self._unused.pop(id(param), (None, None))
        if view is None or version != param._version:  # the first read of this forward, this parameter's
            # second, or a view made before the parameter changed in place (an optimizer step): a new set
            params = [p for p in (m._parameters.get(n) for m, n in self.members) if p is not None and p.requires_grad]
            if not any(p is param for p in params):  # not a registered parameter (functional_call's stand-in)
                return self._one(param)
            views = (copy_many_to_tp(params, group=self.group) if self.holders is None else
                     copy_many_to_replicas(params, group=self.group, holders=self.holders))
            self._unused = {id(p): (v, p._version) for p, v in zip(params, views)}
            view = self._unused.pop(id(param))[0]
        return view

    def _one(self, param: torch.Tensor) -> torch.Tensor:
        """``param`` through its own collective."""
        if self.holders is None:
            return copy_to_tp(param, group=self.group)
        return sum_over_replicas(param, group=self.group, holders=self.holders)
