"""``parallelize(..., tp_invariant=True)``: which converted layers take the fixed-tree path (`tplayers.core.invariant`),
and what this first version refuses, named, before the model runs."""
from __future__ import annotations

import types
from typing import Any, Callable, Dict, Iterable, List

import torch
import torch.nn as nn

from ..core.digest import generator_states
from ..core.groups import TPGroup, resolve_group
from ..core.invariant import LEAVES, check_invariant, leaf_copies
from ..layers.base import TensorParallelModule, params_read_as
from ..layers.conv1d import conv1d_as_linear
from ..layers.fused import FusedColumnParallelLinear
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..layers.siblings import declare_siblings
from ..layers.vocab import ParallelLMHead, VocabParallelEmbedding

__all__ = ["KV_REPLICAS_REASON", "apply_tp_invariant", "run_in_leaves", "LEAF_FORWARD", "is_invariant", "tp1_twin", "declare_twins_alike",
           "leaves_at_tp1"]

#: why the mode refuses KV heads replicated over ranks (parallelize's messages, docs/layers.md)
KV_REPLICAS_REASON = ("A KV head's gradient is the sum over the query heads sharing it: at TP 1 the model's own code "
                      "sums them (repeat_kv's backward, one reduction of torch's choosing); with replicas each rank "
                      "sums its query heads' and the ranks add theirs, so the sum over the query heads sharing a KV "
                      "head takes another order, which tplayers cannot fix inside the model's attention. Use a TP "
                      "degree of at most the KV heads (docs/layers.md)")
LEAF_FORWARD = "_tplayers_leaf_forward"  # marks the forward run_in_leaves gives a module (a dense twin drops it)


def apply_tp_invariant(model: nn.Module, built: Dict[str, nn.Module], tp: TPGroup) -> None:
    """Put the column / row layers and the LM head among the ``built`` modules (name -> what replaces it) on the
    fixed-tree path, after checking them all; refuse what would still sum in a TP-dependent order. The embedding
    needs nothing: a token's row is on one rank (the sum over ranks adds zeros); nor does its sequence-parallel
    reduce-scatter. The norms with partial gradients run leaf by leaf (their styles: `run_in_leaves`), the
    vocabulary-parallel loss sums as the tree (`tplayers.convert.loss_parallel`). A training forward that draws
    random numbers (dropout masks) is refused after it (each rank draws its own shards' masks, TP 1 the whole
    tensor's): the random generators' states compared before and after (a few KB copied on the host)."""
    check_invariant(tp.size, "parallelize")
    modules = [(f"{n}.{r}".rstrip("."), m) for n, b in built.items() for r, m in b.named_modules()]
    layers = [(n, m) for n, m in modules if isinstance(m, TensorParallelModule)
              and not isinstance(m, VocabParallelEmbedding)]
    for name, module in layers:
        what = f"parallelize: tp_invariant=True: module '{name}' ({type(module).__name__})"
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead, FusedColumnParallelLinear)):
            raise ValueError(f"{what} sums over ranks in its own way; this version takes column / row layers, fused "
                             "projections, the vocabulary-parallel embedding and LM head (no experts, mixers)")
        fused = isinstance(module, FusedColumnParallelLinear)
        parts = module.placement.parts if fused else [getattr(module, "split", None)]
        if any(part is not None and part.is_uneven for part in parts):
            raise ValueError(f"{what} is split unevenly; the fixed tree needs whole leaves on every rank")
        if fused and module.has_replicas:
            raise ValueError(f"{what} holds KV heads replicated over ranks (fewer KV heads than the TP degree). "
                             + KV_REPLICAS_REASON)
        if isinstance(module, RowParallelLinear) and not module.input_is_parallel:
            raise ValueError(f"{what} takes a whole input (input_is_parallel=False); give it the column layer's shard")
        for size in ([part.size for part in parts] if fused else [module.in_features] if
                     isinstance(module, RowParallelLinear) else [module.weight.shape[0] * tp.size]):
            check_invariant(tp.size, what, size)  # (the head: its vocabulary padded to the TP degree)
    for module in [m for _, m in layers] + [m for _, m in modules if isinstance(m, VocabParallelEmbedding)]:
        module.tp_invariant = True  # (the embedding: nothing to change; its audit compares with TP 1 exactly too)
    states: List[List[torch.Tensor]] = []  # the random generators' states at a training forward's start

    def before(m: nn.Module, args: Any) -> None:
        states[:] = [generator_states()] if m.training else []

    def after(m: nn.Module, args: Any, out: Any) -> None:
        if states and any(not torch.equal(a, b) for a, b in zip(states.pop(), generator_states())):
            raise RuntimeError("tp_invariant=True: this training forward drew random numbers (dropout with p > 0: a "
                               "dropout module, or a config value such as attn_pdrop / attention_dropout); each rank "
                               "draws the masks of its own shards, TP 1 those of the whole tensors, so the bits differ "
                               "between degrees. Set the dropout probabilities to 0 (as RL fine-tuning does), or call "
                               "model.eval()")
    model.register_forward_pre_hook(before)
    model.register_forward_hook(after)


def run_in_leaves(module: nn.Module, group: TPGroup, local_leaves: Callable[[], int], name: str,
                  leaves_in_all: int = LEAVES) -> None:
    """``module`` (replicated, run on this rank's part of an input split along dim -2: a norm on its chunk of the
    sequence, a per-head norm on its heads) runs leaf by leaf: its first input cut into ``local_leaves()``
    consecutive pieces along dim -2, each piece through the module's own forward reading its own copy of the
    module's parameters (`tplayers.core.invariant.leaf_copies`: their gradients summed as the fixed tree), the
    outputs concatenated. Each leaf is the same computation at every TP degree, so are its parameters' gradients.
    ``leaves_in_all``: the leaves over the group (``LEAVES``; a per-head norm's: as many as its heads allow)."""
    names = tuple(n for n, _ in module.named_parameters(recurse=False))

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        key = None if args else "hidden_states"
        x = args[0] if args else kwargs.get(key)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"tp_invariant: module '{name}' ({type(self).__name__}) runs leaf by leaf on its input "
                            "given first or as hidden_states=")
        run = type(self).forward
        leaves = local_leaves()
        present = [(n, p) for n in names if (p := self._parameters.get(n)) is not None]
        params = [p for _, p in present]
        grads = torch.is_grad_enabled() and any(p.requires_grad for p in params)
        if x.dim() < 2 or x.shape[-2] % leaves:
            if grads:
                raise ValueError(f"tp_invariant: module '{name}' ({type(self).__name__}) sums its parameters' "
                                 f"gradients over {leaves_in_all} leaves of dim -2 of its input, {leaves} on this "
                                 f"rank; the input {tuple(x.shape)} does not cut into them (make the sequence length "
                                 f"/ head count a multiple of {leaves_in_all})")
            return run(self, *args, **kwargs)  # no gradient (a decoding step): each token's output as a leaf's
        copies = leaf_copies(params, leaves, group) if grads else [tuple(params)] * leaves
        outs = []
        for piece, read in zip(x.chunk(leaves, dim=-2), copies):
            piece = piece.contiguous()
            with params_read_as((self, n, p) for (n, _), p in zip(present, read)):
                outs.append(run(self, piece, *args[1:], **kwargs) if key is None else
                            run(self, *args, **{**kwargs, key: piece}))
        return torch.cat(outs, dim=-2)

    setattr(forward, LEAF_FORWARD, leaves_in_all)  # (a dense twin runs all of them: leaves_at_tp1)
    module.forward = types.MethodType(forward, module)  # (a copy of the module gets it bound to the copy)


def is_invariant(module: nn.Module) -> bool:
    """Whether ``module`` holds a layer on the fixed-tree path (``parallelize(..., tp_invariant=True)``)."""
    return any(getattr(m, "tp_invariant", False) for m in module.modules())


def tp1_twin(layer: TensorParallelModule) -> nn.Module:
    """What ``layer`` (on the fixed-tree path) computes at TP 1: its dense weights (gathered: collective) in the
    same class at TP 1, on the fixed-tree path; the audit's twin of a ``tp_invariant`` region, equal to the
    bit."""
    dense = layer.to_dense()
    if getattr(layer, "dense_transposed", False):  # a GPT-2 Conv1D: the layer's from_dense takes the nn.Linear
        dense = conv1d_as_linear(dense)
    extra = {"parts": list(layer.parts)} if isinstance(layer, FusedColumnParallelLinear) else {}
    twin = type(layer).from_dense(dense, group=None, **extra)
    twin.tp_invariant = True
    return twin


def declare_twins_alike(twins: Dict[int, nn.Module], layers: Iterable[nn.Module]) -> None:
    """The TP-1 twins (``twins``: id of a layer -> its `tp1_twin`) of ``layers`` declared siblings as the layers
    are: their input gradient's sum has the structure of the region's (leaf by leaf over the set's members)."""
    sets: Dict[int, List[nn.Module]] = {}
    for layer in layers:
        if getattr(layer, "tp_invariant", False) and getattr(layer, "siblings", None) is not None:
            sets.setdefault(id(layer.siblings), []).append(twins[id(layer)])
    for members in sets.values():
        declare_siblings(*members)


def leaves_at_tp1(module: nn.Module, name: str) -> None:
    """A copy of a module ``run_in_leaves`` made leaf by leaf (its forward bound to the copy, for the real group):
    leaf by leaf as at TP 1 (all its leaves of its whole input, nothing across ranks)."""
    leaves = getattr(vars(module)["forward"].__func__, LEAF_FORWARD)
    run_in_leaves(module, resolve_group(None), lambda: leaves, name, leaves)
