"""The vocabulary-parallel styles: an embedding split by rows of its table, an LM head split like it (a head
tied to the embedding stays tied). The contract is :mod:`tplayers.convert.styles`'.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..layers.base import class_name
from ..layers.vocab import ParallelLMHead, VocabParallelEmbedding, embedding_scale
from .styles import BuildContext, Built, refuse_own_forward, with_saved_copies, is_peft_saved_copies

__all__ = ["VocabEmbedding", "VocabHead"]


@dataclass(frozen=True)
class VocabEmbedding:
    """Split an ``nn.Embedding``'s rows (the vocabulary, padded to the TP degree) across ranks.
    A scaled embedding (``forward = embedding(ids) * embed_scale``, Gemma's) keeps its scale."""

    sequence_parallel: bool = False
    partial_output: bool = False  # sequence-parallel variants: the first block reduce-scatters the lookup

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        if is_peft_saved_copies(module):
            return with_saved_copies(self, module, ctx)
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"parallelize: module '{ctx.name}' is a {class_name(module)}; style "
                            "'vocab_embedding' needs an nn.Embedding")
        try:  # a scaled embedding (Gemma's) keeps its scale; any other own forward is refused
            embedding_scale(module)
        except TypeError as e:
            raise TypeError(f"parallelize: module '{ctx.name}' (style 'vocab_embedding'): {e}. Leave it out of "
                            "the plan ('replicate') to keep it dense") from None
        return Built(VocabParallelEmbedding.from_dense(module, group=ctx.group, sequence_parallel=self.sequence_parallel,
                                                       partial_output=self.partial_output),
                     region="enter_sequence" if self.sequence_parallel else None)  # (its lookup reduce-scatters)


@dataclass(frozen=True)
class VocabHead:
    """An LM head ``nn.Linear(dim, vocab)`` split along the (padded) vocabulary, its bias (if any) too.

    ``gather_output=True`` (default) returns full logits, so a model computing its own loss keeps
    working; False keeps this rank's shard for ``vocab_parallel_cross_entropy``. Same placement as
    :class:`VocabEmbedding`, so a head tied to the embedding stays tied.
    """

    gather_output: bool = True

    def build(self, module: nn.Module, ctx: BuildContext) -> Built:
        if is_peft_saved_copies(module):
            return with_saved_copies(self, module, ctx)
        if not isinstance(module, nn.Linear):
            raise TypeError(f"parallelize: module '{ctx.name}' is a {class_name(module)}; style "
                            "'vocab_head' needs an nn.Linear")
        refuse_own_forward(module, nn.Linear, ctx, "vocab_head")
        return Built(ParallelLMHead.from_dense(module, group=ctx.group, gather_output=self.gather_output))
