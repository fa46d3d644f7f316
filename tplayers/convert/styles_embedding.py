"""`KVEmbedding`: an embedding whose output the model reads as KV heads, split as the KV projections are.

nanochat's value embeddings (ResFormer): a per-layer ``nn.Embedding(vocab, kv_heads * head_dim)`` looked up by
the token ids and added to ``v`` head by head (``v + gate * ve.view(b, s, kv_heads, head_dim)``). With ``v`` split
by :class:`~tplayers.convert.styles.KVColumn`, the lookup must give each rank the same KV heads' columns:
:class:`~tplayers.layers.column_embedding.ColumnParallelEmbedding` cut by the KV-head rule
(:func:`~tplayers.core.head_layout.kv_part`; fewer KV heads than ranks: replicas, their gradients summed).
The contract is :mod:`tplayers.convert.styles`'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch.nn as nn

from ..core.head_layout import kv_part
from ..core.placement import kv_shards
from ..layers.base import class_name
from ..layers.column_embedding import ColumnParallelEmbedding
from .styles import BuildContext, Built, read_count

__all__ = ["KVEmbedding"]


@dataclass(frozen=True)
class KVEmbedding:
    """Split an ``nn.Embedding(num, kv_heads * head_dim)``'s embedding dim by KV heads, as ``KVColumn`` splits a
    K or V projection (the same ranks hold the same heads). ``kv_heads``: the count, or a dotted attribute path
    on the parent module holding the embedding (value embeddings usually sit outside the attention: give the
    number, e.g. ``KVEmbedding(kv_heads=config.n_kv_head)``)."""

    kv_heads: Union[int, str]

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"parallelize: module '{ctx.name}' is a {class_name(module)}; style KVEmbedding needs "
                            "an nn.Embedding")
        count = read_count(self.kv_heads, ctx, "KVEmbedding", "kv_heads")
        if count < 1 or module.embedding_dim % count:
            raise ValueError(f"KVEmbedding: '{ctx.name}' has embedding_dim={module.embedding_dim}, not whole heads of "
                             f"{count} KV heads")
        kv_shards(count, ctx.group.size, "KVEmbedding", f"kv_heads={count}")  # refuses what neither splits nor replicates
        split = kv_part(count, module.embedding_dim // count, ctx.group.size, "KVEmbedding", "kv_heads")
        return Built(ColumnParallelEmbedding.from_dense(module, group=ctx.group, split=split))
