"""Hugging Face Bloom: fused ``query_key_value`` laid out per head (``view(b, s, num_heads, 3, head_dim)``),
so a contiguous column split gives each rank whole heads; ``dense`` / ``dense_4h_to_h`` row,
``dense_h_to_4h`` column; the head tied to ``word_embeddings`` (both vocab-parallel, still one tensor);
``word_embeddings_layernorm`` and the other norms stay replicated.

ALiBi: ``BloomModel`` builds the position biases for all heads, ``(batch * num_heads, 1, kv_length)``,
and hands the same tensor to every block. Each attention on a rank holds heads ``[r * h/p, (r + 1) * h/p)``,
so :class:`LocalAlibi` cuts the biases of those heads out of it before the attention runs.

Refused: ``pretraining_tp > 1`` with ``slow_but_exact=True``, whose forward slices ``dense.weight`` by hand
and so bypasses the row-parallel layer's sum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn as nn

from ...core.placement import require_divisible
from ..plan import Plan, local_head_attrs
from ..styles import BuildContext, Built

__all__ = ["PLAN", "LocalAlibi"]


def _local_alibi(alibi: torch.Tensor, heads: int, start: int, count: int) -> torch.Tensor:
    """``(batch * heads, 1, kv)`` -> the biases of heads ``[start, start + count)``: ``(batch * count, 1, kv)``."""
    return alibi.unflatten(0, (-1, heads)).narrow(1, start, count).flatten(0, 1)


@dataclass(frozen=True)
class LocalAlibi:
    """A Bloom attention (kept in place) that receives this rank's heads' ALiBi biases: a forward pre-hook
    cuts heads ``[rank * h/p, (rank + 1) * h/p)`` out of its ``alibi`` argument (built by the model for all
    ``h`` heads, batch-major). Its fused ``query_key_value`` must be split by whole heads in rank order
    (a plain column split of Bloom's per-head layout is)."""

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        layer = f"parallelize: module '{ctx.name}'"
        if getattr(module, "pretraining_tp", 1) > 1 and getattr(module, "slow_but_exact", False):
            raise ValueError(f"{layer}: Bloom with pretraining_tp={module.pretraining_tp} and slow_but_exact=True is "
                             "not supported (its forward slices dense.weight by hand, bypassing the row-parallel "
                             "layer's sum); set config.slow_but_exact=False (the same math, summed in one matmul)")
        heads = module.num_heads
        count = require_divisible(heads, ctx.group.size, layer, "num_heads")
        start, tp = ctx.group.rank * count, ctx.group.size

        def pre_hook(m: nn.Module, args: Tuple, kwargs: dict) -> Tuple[Tuple, dict]:
            if "alibi" in kwargs:
                return args, {**kwargs, "alibi": _local_alibi(kwargs["alibi"], heads, start, count)}
            if len(args) > 2:  # forward(hidden_states, residual, alibi, ...)
                return args[:2] + (_local_alibi(args[2], heads, start, count),) + tuple(args[3:]), kwargs
            raise TypeError(f"{layer}: expected the ALiBi biases as 'alibi=' or the third argument")

        def finish() -> None:
            if tp > 1:
                module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return Built(module, finish=finish, label=f"{type(module).__name__} with this rank's ALiBi heads")


PLAN = Plan(
    name="bloom",
    layers={
        "*word_embeddings": "vocab_embedding",
        "*h.*.self_attention": LocalAlibi(),
        "*h.*.self_attention.query_key_value": "column",
        "*h.*.self_attention.dense": "row",
        "*h.*.mlp.dense_h_to_4h": "column",
        "*h.*.mlp.dense_4h_to_h": "row",
        "lm_head": "vocab_head",
    },
    # the attention reshapes with num_heads (read from config.n_head, which stays whole); older versions
    # also read hidden_size / split_size
    divide_attrs={"*h.*.self_attention": ("hidden_size?", "split_size?")},
    set_attrs={"*h.*.self_attention": local_head_attrs},
)
