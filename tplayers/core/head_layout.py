"""Attention heads as placements: how q, k and v rows are cut over the TP degree, whole heads only, each query
head on a rank holding its KV head (replicated KV heads where there are fewer than ranks; uneven pieces where
the heads do not divide the TP degree). Built on :mod:`.placement`'s `Part` and `Sharded`."""
from __future__ import annotations

from typing import Tuple

from .placement import Part, Sharded, balanced, require_positive, uneven_part

__all__ = ["head_parts", "kv_part", "qkv_placement"]


def head_parts(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int,
               layer: str = "attention") -> Tuple[Part, Part]:
    """``(query part, key/value part)``: how the query heads and the KV heads (each of K and V) are cut
    at TP degree ``tp_size``, whole heads only and each query head on a rank holding its KV head (the
    ``num_heads / num_kv_heads`` query heads of a KV head are consecutive, as ``repeat_kv`` assumes).

    - Fewer KV heads than ranks: each KV head held by consecutive ranks (as many each when they divide
      the TP degree, :func:`kv_shards`; else as evenly as possible: 2 KV heads at TP 3 by 2 and 1), its
      query heads split over the ranks holding it as evenly as possible.
    - More KV heads than ranks, not dividing: the KV heads as evenly as possible (:func:`balanced`),
      each rank the query heads of its KV heads (groups kept whole).
    Uneven parts pad every rank to the largest piece: a rank with fewer query heads has zero heads after
    its own (attributes such as ``num_heads`` count the padded width; see the module docstring)."""
    require_positive(num_heads, layer, "num_heads")
    require_positive(num_kv_heads, layer, "num_kv_heads")
    require_positive(head_dim, layer, "head_dim")
    if num_heads % num_kv_heads:
        raise ValueError(f"{layer}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads  # query heads per KV head
    kv = kv_part(num_kv_heads, head_dim, tp_size, layer)
    if kv.shards == tp_size:  # each rank whole KV heads, and the query heads that use them
        return uneven_part(num_heads * head_dim, [kv.piece(j)[1] * group for j in range(tp_size)]), kv
    # the ranks holding each (replicated) KV head split its query heads
    q_counts = [c for n in kv.holder_counts(tp_size) for c in balanced(group, n, head_dim)]
    return uneven_part(num_heads * head_dim, q_counts), kv


def kv_part(num_kv_heads: int, head_dim: int, tp_size: int, layer: str = "attention",
            what: str = "num_kv_heads") -> Part:
    """How a K or V projection's ``num_kv_heads * head_dim`` rows are cut: at least as many KV heads as
    ranks, whole heads per rank as evenly as possible; fewer, each head on consecutive ranks (replicas),
    as many ranks each as possible (:func:`kv_shards` when they divide the TP degree)."""
    require_positive(num_kv_heads, layer, what)
    if num_kv_heads >= tp_size:
        return uneven_part(num_kv_heads * head_dim, balanced(num_kv_heads, tp_size, head_dim))
    holders = balanced(tp_size, num_kv_heads)  # ranks per KV head; equal when they divide the TP degree
    return Part(num_kv_heads * head_dim, num_kv_heads, holders=None if len(set(holders)) == 1 else holders)


def qkv_placement(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, *, dim: int = 0,
                  layer: str = "attention") -> Sharded:
    """Fused ``[q; k; v]`` projection: the parts of :func:`head_parts` (q, k, v)."""
    q, kv = head_parts(num_heads, num_kv_heads, head_dim, tp_size, layer)
    return Sharded(dim, (q, kv, kv))
