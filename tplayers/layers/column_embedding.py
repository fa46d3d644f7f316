"""`ColumnParallelEmbedding`: an embedding table split along its embedding dim (the lookup's output features).

A lookup whose output the model reads as attention heads (nanochat's value embeddings, added to ``v`` per KV
head) must be split as the heads are: rank r holds the columns of its heads, looks its tokens up locally
(no collective) and gets ``(..., dim_local)``, exactly the dense lookup's columns. Cut by a
:class:`~tplayers.core.placement.Part`: evenly, or by KV heads (:func:`~tplayers.core.head_layout.kv_part`),
fewer heads than ranks giving replicas: then each holder's output gradient is part of the sum (its ranks' query
heads read the same KV head), summed over the holders before the table's gradient, so every replica computes the
same gradient (one all-reduce of ``(tokens, dim_local)``; the table's is vocabulary-sized).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.comm import sum_over_replicas
from ..core.groups import GroupLike, replica_group, resolve_group
from ..core.placement import Part, Placement, Sharded, require_positive
from ..core.validate import check_index_range
from .base import TensorParallelModule, class_name
from .from_dense import load_full_params, new_param
from .vocab import embedding_scale

__all__ = ["ColumnParallelEmbedding"]


class ColumnParallelEmbedding(TensorParallelModule):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with the embedding dim split across the TP group:
    ``weight`` ``(num_embeddings, dim_local)``; ids ``(...)`` whole on every rank; output ``(..., dim_local)``,
    this rank's columns of the dense lookup. ``split``: how the dim is cut (a Part of ``embedding_dim`` into one
    piece per rank, or fewer pieces held by several ranks each); None: evenly."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: GroupLike, split: Optional[Part] = None,
                 device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.group = tp = resolve_group(group)
        require_positive(num_embeddings, "ColumnParallelEmbedding", "num_embeddings")
        require_positive(embedding_dim, "ColumnParallelEmbedding", "embedding_dim")
        if split is None:
            if embedding_dim % tp.size:
                raise ValueError(f"ColumnParallelEmbedding: embedding_dim={embedding_dim} is not divisible by the TP "
                                 f"degree {tp.size}; pass split= (a Part, e.g. by KV heads)")
            split = Part(embedding_dim, tp.size)
        if not isinstance(split, Part) or split.size != embedding_dim or split.padded or split.is_uneven:
            raise ValueError(f"ColumnParallelEmbedding: split={split!r} must be an even Part of embedding_dim="
                             f"{embedding_dim} (no padding, no uneven pieces)")
        self.placement = Sharded(1, (split,))
        self.placement.check_size(tp.size)
        self.split, self.num_embeddings, self.embedding_dim = split, num_embeddings, embedding_dim
        self.embedding_dim_per_rank = split.local_size
        self.holders = split.holder_counts(tp.size)  # ranks per piece: > 1 when replicated
        if max(self.holders) > 1:
            replica_group(tp, self.holders)  # (every rank builds the replica groups now)
        self.weight = nn.Parameter(torch.empty(num_embeddings, self.embedding_dim_per_rank, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Redraw ``nn.Embedding``'s init (normal) of the full table and keep this rank's columns."""
        full = torch.empty(self.num_embeddings, self.embedding_dim, device=self.weight.device, dtype=self.weight.dtype)
        if full.device.type != "meta":
            nn.init.normal_(full)
        load_full_params(self, {"weight": full})

    def param_placements(self) -> Dict[str, Placement]:
        return {"weight": self.placement}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"ColumnParallelEmbedding: ids must be an integer tensor, got {ids.dtype}")
        check_index_range(ids, self.num_embeddings, f"ColumnParallelEmbedding(num_embeddings={self.num_embeddings})")
        out = F.embedding(ids, self.weight)  # (..., dim_local)
        if max(self.holders) == 1:
            return out
        return sum_over_replicas(out.reshape(-1, out.shape[-1]), group=self.group,  # (tokens, dim_local)
                                 holders=self.holders).view(out.shape)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "ColumnParallelEmbedding":
        """This rank's columns of an existing ``nn.Embedding`` (left untouched); ``options``: ``split=``."""
        if not isinstance(dense, nn.Embedding):
            raise TypeError(f"ColumnParallelEmbedding.from_dense expects an nn.Embedding, got {class_name(dense)}")
        options_used = [n for n, bad in (("padding_idx", dense.padding_idx is not None), ("max_norm", dense.max_norm
                        is not None), ("scale_grad_by_freq", dense.scale_grad_by_freq), ("sparse", dense.sparse)) if bad]
        if options_used or embedding_scale(dense) is not None:
            raise ValueError(f"ColumnParallelEmbedding.from_dense: {type(dense).__name__} with "
                             f"{options_used or 'an embed_scale'} is not supported (a plain lookup only)")
        layer = cls(dense.num_embeddings, dense.embedding_dim, group=group, device="meta", dtype=dense.weight.dtype,
                    **options)
        load_full_params(layer, {"weight": dense.weight}, like=dense)
        return layer

    def to_dense(self) -> nn.Embedding:
        """The full ``nn.Embedding``, gathered on every rank (collective)."""
        dense = nn.Embedding(self.num_embeddings, self.embedding_dim, device="meta")
        dense.weight = new_param(self.gather_param("weight"), self.weight)
        return dense

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp_size={self.group.size}, tp_rank={self.group.rank}, "
                f"embedding_dim_per_rank={self.embedding_dim_per_rank}, holders={self.holders}")
