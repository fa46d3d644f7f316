"""A small GPT built from tplayers blocks: the reference for composing them.

    ids (b, s) ──VocabParallelEmbedding──> (b, s, h)          [(b, s/p, h) with sequence parallelism]
       ──ParallelTransformerBlock × n_layers──> ──ParallelNorm──>
       ──ParallelLMHead──> logits shard (b, s, V'/p)         [the vocabulary split, never gathered]
       ──vocab_parallel_cross_entropy(..., vocab_size=V)──> loss

Its dense twin is `tplayers.models.dense.DenseGPT` (same parameter names): ``ParallelGPT.from_dense``
shards one, ``to_dense`` gathers it back.

    rng = tplayers.RNGTracker(seed, group=g)            # only needed when dropout > 0
    model = ParallelGPT(GPTConfig(vocab_size=50257, hidden=768, n_heads=12, ffn_hidden=3072,
                                  n_layers=12), group=g, sequence_parallel=True, rng=rng)
    loss = model.loss(ids, targets)                       # identical ids/targets on every rank
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from .blocks import ParallelTransformerBlock
from .cache import KVCache, greedy_decode
from ..core.comm import gather_from_tp
from .dense import DenseGPT, GPTConfig
from ..layers.vocab import ParallelLMHead, VocabParallelEmbedding
from ..core.groups import GroupLike, resolve_group
from ..layers.base import TensorParallelModule
from .loss import vocab_parallel_cross_entropy
from ..layers.norm import ParallelNorm
from .rng import RNGTracker, activation_dropout, require_rng

__all__ = ["ParallelGPT"]


class ParallelGPT(TensorParallelModule):
    """`DenseGPT`, tensor-parallel: ``forward(ids)`` returns this rank's logits shard
    ``(b, s, V'/p)``; ``logits(ids)`` the full ``(b, s, V)``; ``loss(ids, targets)`` the mean
    cross-entropy, computed without gathering the logits."""

    def __init__(self, config: GPTConfig, *, group: GroupLike, sequence_parallel: bool = False,
                 rng: Optional[RNGTracker] = None, overlap_comm: bool = True, device: Any = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        c = self.config = config
        self.group = tp = resolve_group(group)
        require_rng(rng, tp, "ParallelGPT", "dropout", c.dropout)
        self.rng, self.sequence_parallel = rng, sequence_parallel
        sp = dict(group=tp, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.embed = VocabParallelEmbedding(c.vocab_size, c.hidden, **sp)
        self.blocks = nn.ModuleList(
            ParallelTransformerBlock(c, rng=rng, overlap_comm=overlap_comm, **sp) for _ in range(c.n_layers))
        self.norm = ParallelNorm(c.hidden, c.norm, c.norm_eps, c.bias, **sp)
        self.head = ParallelLMHead(c.hidden, c.vocab_size, overlap_comm=overlap_comm, **sp)

    def forward(self, ids: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        x = self.embed(ids)  # (b, s, h) | (b, s/p, h)
        x = activation_dropout(x, self.config.dropout if self.training else 0.0, self.rng, self.sequence_parallel)
        for i, block in enumerate(self.blocks):
            x = block(x, attn_mask, None if cache is None else cache.layers[i])
        return self.head(self.norm(x))  # (b, s, V'/p): the whole sequence, this rank's vocabulary

    def logits(self, ids: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
               cache: Optional[KVCache] = None) -> torch.Tensor:
        """The full logits ``(b, s, V)`` on every rank (gathered; padding removed)."""
        return gather_from_tp(self(ids, attn_mask, cache), group=self.group)[..., : self.config.vocab_size]

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding with a KV cache (each rank caches its KV heads), as `DenseGPT.generate`:
        ``ids (b, s) -> (b, s + max_new_tokens)``, the same tokens on every rank."""
        if self.sequence_parallel and self.group.size > 1:
            raise ValueError("ParallelGPT.generate: decoding feeds one token per step, which cannot be split along "
                             "the sequence; build the model with sequence_parallel=False for generation (same weights: "
                             "from_dense or load_checkpoint)")
        return greedy_decode(lambda new, cache: self.logits(new, cache=cache), ids, len(self.blocks), max_new_tokens)

    def loss(self, ids: torch.Tensor, targets: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
             ignore_index: int = -100) -> torch.Tensor:
        """Mean next-token cross-entropy; the logits are never gathered."""
        return vocab_parallel_cross_entropy(self(ids, attn_mask), targets, group=self.group,
                                            vocab_size=self.config.vocab_size, ignore_index=ignore_index)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "ParallelGPT":
        if not isinstance(dense, DenseGPT):
            raise TypeError(f"ParallelGPT.from_dense expects a tplayers.models.dense.DenseGPT, got {type(dense).__name__}")
        tp = resolve_group(group)
        model = cls(dense.config, group=tp, device="meta", dtype=dense.head.weight.dtype, **options)
        sp = dict(sequence_parallel=model.sequence_parallel)
        overlap = model.head.overlap_comm
        model.embed = VocabParallelEmbedding.from_dense(dense.embed, group=tp, **sp)
        model.blocks = nn.ModuleList(ParallelTransformerBlock.from_dense(b, group=tp, rng=model.rng,
                                                                         overlap_comm=overlap, **sp)
                                     for b in dense.blocks)
        model.norm = ParallelNorm.from_dense(dense.norm, group=tp, **sp)
        model.head = ParallelLMHead.from_dense(dense.head, group=tp, overlap_comm=overlap, **sp)
        return model

    def to_dense(self) -> DenseGPT:
        dense = DenseGPT(self.config, device="meta")
        dense.embed, dense.norm, dense.head = self.embed.to_dense(), self.norm.to_dense(), self.head.to_dense()
        dense.blocks = nn.ModuleList(b.to_dense() for b in self.blocks)
        return dense

