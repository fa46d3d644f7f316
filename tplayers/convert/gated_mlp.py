"""A converted Hugging Face gated MLP keeps its tokens rank-major under sequence parallelism (``regions/gated.py``).

Llama's MLP and the families that copy it (Mistral, Qwen2/3, Gemma 1/2, OLMo 1/2, Granite, Cohere, ...) compute
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. ``parallelize`` recognises that forward by its code (the stock one,
not a patched or subclassed one: Liger's is its own; checked again at every call, so a forward patched on the class
later runs as it is) and gives the module an instance ``forward`` that runs the same
expression with gate / up's call keeping its outputs rank-major and down taking them so (``rank_major_row_linear``),
when every condition below holds at the call; otherwise the module's own forward runs, unchanged:

- sequence parallelism on (the switch: a decoding step turns it off) and a backward to come (eager, grad on: the
  set's call is made only then); not traced (torch.compile), not ``tp_invariant``;
- gate / up the converted ``ColumnParallelLinear`` layers of one declared set of the two, down the converted
  ``RowParallelLinear`` (an even split, no collective matmul), the activation one of transformers' ``ACT2CLS``
  (token-wise);
- no hooks on gate / up / down / act_fn but tplayers' own (code that would see their outputs in rank-major order):
  a hook, FSDP2 on a projection (its hooks), a LoRA wrapper (not the converted layer) each keep the module's own
  forward.

As ``ParallelMLP``'s region, the projections and the activation are called through their ``forward`` (module
hooks on the MLP itself run; global module hooks see the MLP's call, not its members').
"""
from __future__ import annotations

import functools
import types
from typing import Any, Optional, Set, Tuple

import torch
import torch.nn as nn

from ..layers.base import has_foreign_hooks
from ..layers.linear import ColumnParallelLinear, RowParallelLinear, grad_sinks
from ..regions.gated import rank_major_row_linear

__all__ = ["keep_gated_mlp_rank_major", "is_stock_gated_mlp"]

_NAMES = ("gate_proj", "up_proj", "down_proj", "act_fn")


def _llama_forward(self, x):  # transformers' LlamaMLP.forward, its source as it is (the reference, never run)
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


_STOCK = _llama_forward.__code__
_RECOGNISED: Set[types.CodeType] = set()  # forwards found to be the stock one (a check per call: a set lookup)


@functools.lru_cache(maxsize=None)
def _activations() -> Tuple[type, ...]:
    try:
        from transformers.activations import ACT2CLS
    except ImportError:  # (transformers is an optional extra)
        return ()
    classes = {v[0] if isinstance(v, tuple) else v for v in ACT2CLS.values()}
    return tuple(c for c in classes if c is not nn.PReLU)  # (PReLU may hold a weight per channel)


def is_stock_gated_mlp(module: nn.Module) -> bool:
    """Whether ``module``'s class computes Llama's MLP with Llama's own code (its forward's bytecode, names and
    constants, as the class has it now: a forward patched later is not), with the four attributes it reads."""
    code = getattr(type(module).forward, "__code__", None)
    if code is None or not all(hasattr(module, n) for n in _NAMES):
        return False
    if code not in _RECOGNISED and (code.co_code, code.co_names, code.co_consts) == (
            _STOCK.co_code, _STOCK.co_names, _STOCK.co_consts):
        _RECOGNISED.add(code)
    return code in _RECOGNISED


def keep_gated_mlp_rank_major(module: nn.Module) -> bool:
    """Give a stock gated MLP whose projections ``parallelize`` converted for sequence parallelism the forward of the
    module docstring (an instance attribute; ``type(module).forward`` is left as it is). Returns whether it did."""
    if not (is_stock_gated_mlp(module) and type(module.gate_proj) is ColumnParallelLinear
            and type(module.up_proj) is ColumnParallelLinear and type(module.down_proj) is RowParallelLinear
            and module.down_proj.sequence_parallel):  # (a plan without sequence parallelism: nothing to keep)
        return False
    object.__setattr__(module, "forward", types.MethodType(_Gated.forward, module))
    return True


def _kept_call(mlp: nn.Module, x: torch.Tensor) -> Optional[Tuple[Any, ...]]:
    """``(gate, up, down, act)`` when the call may keep its tokens rank-major (the module docstring), else None."""
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and x.requires_grad) or \
            not is_stock_gated_mlp(mlp):
        return None  # (a traced graph, no backward to come: the set's call is not made; a forward patched later)
    gate, up, down, act = (getattr(mlp, n) for n in _NAMES)
    if not (type(gate) is ColumnParallelLinear and type(up) is ColumnParallelLinear and type(down) is RowParallelLinear
            and isinstance(act, _activations()) and gate.siblings is not None and gate.siblings is up.siblings):
        return None
    layers = (gate, up, down)
    if not (down.group.size > 1 and all(m.sequence_parallel and not m.tp_invariant and not m.collective_matmul
                                        for m in layers)
            and not (gate.gather_output or up.gather_output) and down.input_is_parallel
            and not down.split.is_uneven
            and set(map(id, gate.siblings.members)) == {id(gate), id(up)} and x.dim() >= 2
            and not any(has_foreign_hooks(m) for m in (*layers, act))):
        return None
    return gate, up, down, act


class _Gated:
    """The forwards of the kept path, each named ``forward`` with its module as ``self``: the collective checks name a
    collective's site from the frames (``core/sites.py``), so the kept path's read as the module's own would (a rank
    that runs the module's own forward, where a hook is registered on that rank alone, agrees with one that does
    not: the same data, shapes and sites on the wire)."""

    @staticmethod
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:  # (the MLP's)
        kept = _kept_call(self, x)
        if kept is None:
            return type(self).forward(self, x)
        gate, up, down, act = kept
        inputs = gate.siblings.inputs
        with inputs.keep_rank_major(gate.siblings):
            h = act.forward(gate.forward(x)) * up.forward(x)  # (b, s, ffn/p): tokens rank-major if the call kept them
            call = inputs.call
        if call is None or not call.kept or set(call.weights) != {id(gate.weight), id(up.weight)}:
            if call is not None and call.kept:  # (one member in the kept call, one not: h mixes two orders)
                raise RuntimeError(f"{type(self).__name__}: gate_proj and up_proj did not join one call of their set; "
                                   "their outputs are in different token orders")
            return down.forward(h)  # the call was not made (no backward to come): the sequence's order
        return _KeptRow.forward(down, h)  # (b, s/p, hidden)


class _KeptRow:
    @staticmethod
    def forward(self: nn.Module, h: torch.Tensor) -> torch.Tensor:  # (down_proj's, on rank-major tokens)
        sinks = grad_sinks(self)
        return rank_major_row_linear(h, self.weight, self.bias, group=self.group, wgrad_store=sinks["wgrad_store"],
                                     main_grads=sinks["main_grads"])
