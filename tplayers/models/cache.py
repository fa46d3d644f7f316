"""KV cache and greedy decoding for the library's own models (`DenseGPT`, `ParallelGPT`).

Each attention layer keeps the keys and values of the positions seen so far, ``(b, kv_heads, t, d)``
after rotary (a TP model: this rank's KV heads), and attends the new positions' queries to all of
them; rotary angles start at the cached length. Decoding one token at a time then costs one
position's compute per layer instead of the whole prefix.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

__all__ = ["LayerKV", "KVCache", "greedy_decode"]


class LayerKV:
    """One attention layer's cached keys and values."""

    def __init__(self) -> None:
        self.k: Optional[torch.Tensor] = None  # (b, kv_heads, t, d)
        self.v: Optional[torch.Tensor] = None

    @property
    def offset(self) -> int:
        """Positions cached so far: the position of the next query."""
        return 0 if self.k is None else self.k.shape[-2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' ``k, v (b, kv_heads, s, d)``; return all of them ``(b, kv_heads, t + s, d)``."""
        if self.k is not None and (self.k.shape[0] != k.shape[0] or self.k.shape[1] != k.shape[1]):
            raise ValueError(f"KV cache: cached keys {tuple(self.k.shape)} do not fit new keys {tuple(k.shape)} "
                             "(a different batch or model); start a new KVCache per sequence batch")
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)
        return self.k, self.v


class KVCache:
    """The cache of a whole model: one :class:`LayerKV` per block."""

    def __init__(self, n_layers: int) -> None:
        self.layers: List[LayerKV] = [LayerKV() for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].offset if self.layers else 0


def greedy_decode(logits_fn: Callable[[torch.Tensor, KVCache], torch.Tensor], ids: torch.Tensor, n_layers: int,
                  max_new_tokens: int) -> torch.Tensor:
    """``ids (b, s) -> (b, s + max_new_tokens)``: the prompt in one forward, then one token per step,
    each the argmax of the full-vocabulary logits ``logits_fn(new_ids, cache) (b, s_new, V)``."""
    if ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError(f"generate: expected prompt ids (batch, seq >= 1), got {tuple(ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 0")
    cache = KVCache(n_layers)
    new = ids
    for step in range(max_new_tokens):
        logits = logits_fn(new, cache)  # (b, s_new, V)
        new = logits[:, -1].argmax(dim=-1, keepdim=True)  # (b, 1)
        ids = torch.cat([ids, new], dim=1)
    return ids
