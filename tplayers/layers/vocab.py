"""Vocabulary-parallel layers: the embedding table and the LM head, split along the vocabulary.

Rank r holds rows ``[r*V'/p, (r+1)*V'/p)`` of the table, where ``V'`` is the vocabulary padded
up to a multiple of the TP degree p (real tokenizers' vocabularies rarely divide p). The padding
rows are zeros that no token id ever selects; `to_dense` strips them, `from_dense` adds them,
and `vocab_parallel_cross_entropy(..., vocab_size=V)` keeps them out of the loss.

`VocabParallelEmbedding`: every rank looks up only the ids in its vocabulary range (the others
give zeros), then the partial embeddings are all-reduced (reduce-scattered along the sequence
dim under sequence parallelism).

`ParallelLMHead`: ``x @ W.T`` with the vocabulary (output features) split across ranks; its
output is this rank's logits shard, fed to `vocab_parallel_cross_entropy` without ever
gathering the full logits (``gather_output=True`` gathers them, padding removed).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.comm import gather_from_tp, reduce_from_tp, reduce_scatter_to_sequence
from ..core.functional import SEQ_DIM, column_parallel_linear
from ..core.groups import GroupLike, TPGroup, resolve_group
from ..core.placement import Placement, Sharded, require_positive
from ..core.validate import check_index_range
from .base import TensorParallelModule, dense_linear_init, load_full_params, new_param
from .compat import PaddedShardLayout, padded_vocab_size, vocab_range  # noqa: F401  (0.1 names, deprecated)

__all__ = ["VocabParallelEmbedding", "ParallelLMHead"]


class _VocabParallelBase(TensorParallelModule):
    """Shared bookkeeping of a ``(vocab, dim)`` weight split along the padded vocabulary."""

    num_embeddings: int
    weight: nn.Parameter

    def _init_vocab(self, num_embeddings: int, tp: TPGroup) -> None:
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.placement = Sharded.split(0, num_embeddings, tp.size, padded=True)
        self.num_embeddings_per_rank = self.placement.local_size
        self.num_embeddings_padded = self.num_embeddings_per_rank * tp.size
        # the padded rows [vocab_start, vocab_end) this rank holds (those past num_embeddings are zeros)
        self.vocab_start = tp.rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank

    def param_placements(self) -> Dict[str, Placement]:
        return {"weight": self.placement}


class VocabParallelEmbedding(_VocabParallelBase):
    """``nn.Embedding`` with the vocabulary split across the TP group.

    Input: integer ids ``(...)``, identical on every rank. Output ``(..., dim)`` on every rank,
    or ``(..., seq/p, dim)`` with ``sequence_parallel=True`` (ids ``(..., seq)``).
    ``num_embeddings`` need not divide the TP degree (padded, see the module docstring).
    Initialization draws the full ``nn.Embedding`` table (same RNG calls) and keeps this rank's rows.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        *,
        group: GroupLike,
        sequence_parallel: bool = False,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        tp = resolve_group(group)
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(f"VocabParallelEmbedding: num_embeddings={num_embeddings} and "
                             f"embedding_dim={embedding_dim} must be positive")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"VocabParallelEmbedding: padding_idx={padding_idx} is outside the "
                                 f"vocabulary of {num_embeddings}")
            padding_idx %= num_embeddings
        self._init_vocab(num_embeddings, tp)
        self.embedding_dim, self.padding_idx, self.sequence_parallel = embedding_dim, padding_idx, sequence_parallel
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    @property
    def _local_padding_idx(self) -> Optional[int]:
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            return self.padding_idx - self.vocab_start
        return None

    def reset_parameters(self) -> None:
        """Redraw the full ``nn.Embedding`` init (normal(0, 1), padding row zero), keep this rank's rows."""
        full = torch.empty(self.num_embeddings, self.embedding_dim, device=self.weight.device, dtype=self.weight.dtype)
        if full.device.type != "meta":
            nn.init.normal_(full)
            if self.padding_idx is not None:
                with torch.no_grad():
                    full[self.padding_idx].zero_()
        load_full_params(self, {"weight": full})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"VocabParallelEmbedding: ids must be an integer tensor, got {ids.dtype}")
        # ids on the padding rows of an uneven vocabulary would silently embed to zeros
        check_index_range(ids, self.num_embeddings, f"VocabParallelEmbedding(vocab={self.num_embeddings})")
        if self.sequence_parallel and self.tp.size > 1:
            if ids.dim() < 1 or ids.shape[-1] % self.tp.size != 0:
                raise ValueError(
                    f"VocabParallelEmbedding: sequence length {tuple(ids.shape)[-1:]} (ids shape "
                    f"{tuple(ids.shape)}) is not divisible by the TP degree {self.tp.size} "
                    "(sequence parallelism splits it across ranks)")
        if self.tp.size == 1:
            return F.embedding(ids, self.weight, self._local_padding_idx)
        in_shard = (ids >= self.vocab_start) & (ids < self.vocab_end)  # (...)
        local_ids = (ids - self.vocab_start).masked_fill(~in_shard, 0)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)  # (..., dim), partial
        out = out.masked_fill_(~in_shard.unsqueeze(-1), 0.0)  # ids of other ranks contribute zero
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, group=self.tp, seq_dim=SEQ_DIM)  # (..., seq/p, dim)
        return reduce_from_tp(out, group=self.tp)  # (..., dim)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "VocabParallelEmbedding":
        """This rank's rows of an existing ``nn.Embedding`` (the dense module is left untouched)."""
        if not isinstance(dense, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding.from_dense expects an nn.Embedding, got {type(dense).__name__}")
        unsupported = [n for n, bad in (("max_norm", dense.max_norm is not None),
                                        ("scale_grad_by_freq", dense.scale_grad_by_freq),
                                        ("sparse", dense.sparse)) if bad]
        if unsupported:
            raise ValueError(f"VocabParallelEmbedding.from_dense: nn.Embedding options {unsupported} are not supported")
        layer = cls(dense.num_embeddings, dense.embedding_dim, dense.padding_idx, group=group,
                    device="meta", dtype=dense.weight.dtype, **options)
        load_full_params(layer, {"weight": dense.weight}, like=dense)
        return layer

    def to_dense(self) -> nn.Embedding:
        """The full ``nn.Embedding`` (padding removed), gathered on every rank (collective)."""
        dense = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx, device="meta")
        dense.weight = new_param(self.gather_param("weight"), self.weight)
        return dense

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
                f"tp_size={self.tp.size}, tp_rank={self.tp.rank}, rows=[{self.vocab_start}, {self.vocab_end}), "
                f"sequence_parallel={self.sequence_parallel}")


class ParallelLMHead(_VocabParallelBase):
    """The output projection ``nn.Linear(dim, vocab, bias=False)`` split along the vocabulary.

    Input ``(..., dim)`` replicated (``(..., seq/p, dim)`` with ``sequence_parallel``). Output:
    this rank's logits shard ``(..., [seq,] vocab_padded/p)``, whose padding columns are zero;
    pass ``vocab_size=head.num_embeddings`` to `vocab_parallel_cross_entropy`. With
    ``gather_output=True``: the full ``(..., vocab)`` logits on every rank, padding removed.

    Tied embeddings (GPT-2 style): the local weight has the same layout as a
    `VocabParallelEmbedding` of the same vocabulary, so ``head.weight = embedding.weight`` ties
    them rank by rank, and both uses accumulate into the one gradient.
    """

    def __init__(
        self,
        embedding_dim: int,
        num_embeddings: int,
        *,
        group: GroupLike,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        overlap_comm: bool = True,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("ParallelLMHead: gather_output=True cannot be combined with sequence_parallel=True")
        require_positive(embedding_dim, "ParallelLMHead", "embedding_dim")
        require_positive(num_embeddings, "ParallelLMHead", "num_embeddings")
        self._init_vocab(num_embeddings, resolve_group(group))
        self.embedding_dim, self.gather_output = embedding_dim, gather_output
        self.sequence_parallel, self.overlap_comm = sequence_parallel, overlap_comm
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    @property
    def in_features(self) -> int:
        return self.embedding_dim

    @property
    def out_features(self) -> int:
        return self.num_embeddings

    def reset_parameters(self) -> None:
        """Redraw the full ``nn.Linear(dim, vocab, bias=False)`` init and keep this rank's rows."""
        full, _ = dense_linear_init(self.embedding_dim, self.num_embeddings, False, self.weight.device, self.weight.dtype)
        load_full_params(self, {"weight": full})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = column_parallel_linear(x, self.weight, None, group=self.tp,  # (..., V'/p)
                                        sequence_parallel=self.sequence_parallel, overlap_comm=self.overlap_comm)
        if not self.gather_output:
            return logits
        return gather_from_tp(logits, group=self.tp)[..., : self.num_embeddings]  # (..., V)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "ParallelLMHead":
        """This rank's rows of an existing bias-free ``nn.Linear(dim, vocab)``."""
        if not isinstance(dense, nn.Linear):
            raise TypeError(f"ParallelLMHead.from_dense expects an nn.Linear, got {type(dense).__name__}")
        if dense.bias is not None:
            raise ValueError("ParallelLMHead.from_dense: the LM head must have no bias")
        layer = cls(dense.in_features, dense.out_features, group=group, device="meta",
                    dtype=dense.weight.dtype, **options)
        load_full_params(layer, {"weight": dense.weight}, like=dense)
        return layer

    def to_dense(self) -> nn.Linear:
        """The full ``nn.Linear(dim, vocab, bias=False)`` (padding removed), on every rank (collective)."""
        dense = nn.Linear(self.embedding_dim, self.num_embeddings, bias=False, device="meta")
        dense.weight = new_param(self.gather_param("weight"), self.weight)
        return dense

    def extra_repr(self) -> str:
        return (f"embedding_dim={self.embedding_dim}, vocab={self.num_embeddings}, tp_size={self.tp.size}, "
                f"tp_rank={self.tp.rank}, rows=[{self.vocab_start}, {self.vocab_end}), "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")
