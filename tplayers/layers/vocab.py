"""Vocabulary-parallel layers: the embedding table and the LM head, split along the vocabulary.

Rank r holds rows ``[r*V'/p, (r+1)*V'/p)`` of the table, where ``V'`` is the vocabulary padded
up to a multiple of the TP degree p (real tokenizers' vocabularies rarely divide p). The padding
rows are zeros that no token id ever selects; `to_dense` strips them, `from_dense` adds them,
and `vocab_parallel_cross_entropy(..., vocab_size=V)` keeps them out of the loss.

`VocabParallelEmbedding`: every rank looks up only the ids in its vocabulary range (the others
give zeros), then the partial embeddings are all-reduced (reduce-scattered along the sequence
dim under sequence parallelism: with a batch, looked up in the collective's rank-major token order, the
ids reordered instead of the lookup and its gradient, ``core/seq_order.py``). ``scale=`` multiplies the
output by a constant, the scaled embeddings of Gemma-style models (`ScaledEmbedding` is its dense twin).

`ParallelLMHead`: ``x @ W.T (+ b)`` with the vocabulary (output features) split across ranks, the
bias (Phi, GPT-J, CodeGen) split like the weight rows, padding entries zero; its output is this
rank's logits shard, fed to `vocab_parallel_cross_entropy` without ever
gathering the full logits (``gather_output=True`` gathers them, padding removed).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.comm import gather_from_tp, reduce_from_tp, reduce_scatter_to_sequence
from ..core.collectives import SEQ_DIM
from ..core.functional import column_parallel_linear
from ..core.groups import GroupLike, TPGroup, resolve_group
from ..core.invariant import invariant_column_linear
from ..core.siblings import Siblings
from ..core.seq_order import ids_in_rank_major, lookup_rank_major, reduce_scatter_rank_major
from ..regions.partial_sum import ScatterOrder, partial_sum
from ..core.placement import Placement, Sharded, require_positive
from ..core.validate import check_index_range
from .base import TensorParallelModule, class_name
from .from_dense import dense_linear_init, linear_to_dense, load_full_params, new_param, own_forward
from .linear import refuse_with_invariant

__all__ = ["VocabParallelEmbedding", "ParallelLMHead", "ScaledEmbedding", "embedding_scale"]

ScaleLike = Union[None, float, torch.Tensor]


class ScaledEmbedding(nn.Embedding):
    """``nn.Embedding`` whose output is multiplied by ``embed_scale`` (cast to the weight's dtype
    first, as Hugging Face's ``*ScaledWordEmbedding`` classes do). The dense twin of
    ``VocabParallelEmbedding(scale=...)``; the scale is a non-persistent buffer (not in state_dict)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None, *,
                 scale: Union[float, torch.Tensor], **kwargs: Any) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx, **kwargs)
        self.register_buffer("embed_scale", _scale_tensor(scale, self.weight.device), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


def _scale_tensor(scale: Union[float, torch.Tensor], device: Any) -> torch.Tensor:
    """A 0-d tensor of ``scale``: a tensor keeps its dtype (HF's float32 buffer), a number is float64."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"embedding scale must be a single number, got a tensor of shape {tuple(scale.shape)}")
        return scale.detach().reshape(()).clone().to(device)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"embedding scale must be a finite number, got {scale!r}")
    return torch.tensor(float(scale), dtype=torch.float64, device=device)


def embedding_scale(dense: nn.Embedding) -> Optional[torch.Tensor]:
    """The scale of a scaled embedding, None for a plain one; refuses any other ``forward``.

    A subclass of ``nn.Embedding`` with its own ``forward`` is accepted only when it has an
    ``embed_scale`` (tensor or number; Hugging Face's ``*ScaledWordEmbedding``) and its forward is
    exactly ``embedding(ids) * embed_scale.to(weight.dtype)``: checked bitwise on a small probe
    table (swapped in for the call, so meta modules and huge vocabularies cost nothing; a local
    generator, so no RNG stream moves). Anything else is a TypeError naming the class.
    """
    if not own_forward(dense, nn.Embedding):
        return None
    name = type(dense).__name__
    scale = getattr(dense, "embed_scale", None)
    if scale is None:
        raise TypeError(f"{name} is a subclass of nn.Embedding with its own forward and no 'embed_scale': "
                        "tplayers supports scaled embeddings (forward = embedding(ids) * embed_scale) only; "
                        "a plain VocabParallelEmbedding would drop that forward")
    if isinstance(scale, torch.Tensor) and scale.device.type == "meta":
        scalar = getattr(dense, "scalar_embed_scale", None)  # HF keeps the number beside the meta buffer
        if scalar is None:
            raise TypeError(f"{name}: its embed_scale is on the meta device (its value is unknown) and it has "
                            "no scalar_embed_scale; materialize the module before converting it")
        scale = torch.tensor(float(scalar), dtype=scale.dtype)
    scale = _scale_tensor(scale, "cpu" if dense.weight.device.type == "meta" else dense.weight.device)
    rows = min(dense.num_embeddings, 8)
    gen = torch.Generator(device=scale.device).manual_seed(0)
    probe = torch.randn(rows, dense.embedding_dim, generator=gen, device=scale.device).to(dense.weight.dtype)
    ids = torch.arange(rows, device=scale.device).repeat(2, 1)  # (2, rows): a batch, every row
    probe_state = {"weight": probe}
    if isinstance(getattr(dense, "embed_scale"), torch.Tensor):
        probe_state["embed_scale"] = scale
    with torch.no_grad():
        got = torch.func.functional_call(dense, probe_state, (ids,))
    want = F.embedding(ids, probe) * scale.to(probe.dtype)
    if not (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
            and torch.equal(got, want)):
        raise TypeError(f"{name}: its forward is not embedding(ids) * embed_scale (checked on a probe table), "
                        "so a VocabParallelEmbedding would compute something else; tplayers supports "
                        "only that form of nn.Embedding subclass")
    return scale


class _VocabParallelBase(TensorParallelModule):
    """Shared bookkeeping of a ``(vocab, dim)`` weight split along the padded vocabulary."""

    num_embeddings: int
    weight: nn.Parameter

    def _init_vocab(self, num_embeddings: int, tp: TPGroup) -> None:
        self.group = tp
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
    or ``(..., seq/p, dim)`` with ``sequence_parallel=True`` (ids ``(..., seq)``). ``partial_output=True``:
    ``(..., dim)`` as a :class:`~tplayers.regions.partial_sum.PartialSum`, summed when its values are first read,
    or reduce-scattered by a sequence-parallel region's entry (a Hugging Face model reads its shape first).
    ``num_embeddings`` need not divide the TP degree (padded, see the module docstring).
    Initialization draws the full ``nn.Embedding`` table (same RNG calls) and keeps this rank's rows.
    """

    tp_invariant = False  # parallelize(..., tp_invariant=True) marks it: the same bits already (the other ranks add
    # zeros); its audit then compares with TP 1's exactly

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        *,
        group: GroupLike,
        sequence_parallel: bool = False,
        partial_output: bool = False,
        scale: ScaleLike = None,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        tp = resolve_group(group)
        if partial_output and sequence_parallel:
            raise ValueError("VocabParallelEmbedding: partial_output=True returns the unsummed (b, s, dim) lookup for "
                             "a later reduce-scatter; sequence_parallel=True reduce-scatters it here: pass one")
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
        self.partial_output = partial_output
        self._scatter_order = ScatterOrder()  # partial_output: whether the last lookup was reduce-scattered unread
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_rank, embedding_dim, device=device, dtype=dtype))
        # non-persistent, like HF's: checkpoints hold the same keys as a plain embedding's
        self.register_buffer("embed_scale", None if scale is None else _scale_tensor(scale, device), persistent=False)
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
        if self.sequence_parallel and self.group.size > 1:
            if ids.dim() < 1 or ids.shape[-1] % self.group.size != 0:
                raise ValueError(
                    f"VocabParallelEmbedding: sequence length {tuple(ids.shape)[-1:]} (ids shape "
                    f"{tuple(ids.shape)}) is not divisible by the TP degree {self.group.size} "
                    "(sequence parallelism splits it across ranks)")
        if self.group.size == 1:
            return self._scaled(F.embedding(ids, self.weight, self._local_padding_idx))
        rank_major = self._rank_major(ids)
        if rank_major:  # looked up in the reduce-scatter's own token order: the ids copied, not the lookup
            ids = ids_in_rank_major(ids, self.group.size)  # (..., seq), rank-major
        in_shard = (ids >= self.vocab_start) & (ids < self.vocab_end)  # (...)
        local_ids = (ids - self.vocab_start).masked_fill(~in_shard, 0)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)  # (..., dim), partial
        out = out.masked_fill_(~in_shard.unsqueeze(-1), 0.0)  # ids of other ranks contribute zero
        # scaled before the reduction: each position is nonzero on exactly one rank, so this is
        # bitwise the dense ``embedding * scale``
        out = self._scaled(out)
        if self.sequence_parallel and rank_major:
            return reduce_scatter_rank_major(out, group=self.group)  # (..., seq/p, dim)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, group=self.group, seq_dim=SEQ_DIM)  # (..., seq/p, dim)
        if self.partial_output:  # summed when read; reduce-scattered by the sequence-parallel region's entry
            return partial_sum(out, group=self.group, source=self, rank_major=rank_major,
                               order=self._scatter_order)  # (..., dim)
        return reduce_from_tp(out, group=self.group)  # (..., dim)

    def _rank_major(self, ids: torch.Tensor) -> bool:
        """Whether this lookup is made in rank-major token order (core/seq_order.py): it is reduce-scattered along
        the sequence (sequence_parallel; partial_output: the last one was, unread), there is a batch, and neither
        tp_invariant (TP 1's bits: the weight gradient accumulated in the sequence's order) nor a compiled graph
        (whose PartialSum is summed at once) runs it."""
        if not lookup_rank_major(ids, self.group.size) or self.tp_invariant or torch.compiler.is_compiling():
            return False
        return self.sequence_parallel or (self.partial_output and self._scatter_order.rank_major)

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.embed_scale is None else out * self.embed_scale.to(self.weight.dtype)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "VocabParallelEmbedding":
        """This rank's rows of an existing ``nn.Embedding`` (the dense module is left untouched).
        A scaled embedding (see `embedding_scale`) keeps its scale; other subclasses with their own
        forward are refused."""
        if not isinstance(dense, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding.from_dense expects an nn.Embedding, got {class_name(dense)}")
        scale = embedding_scale(dense)
        if scale is not None:
            if options.get("scale") is not None:
                raise ValueError(f"VocabParallelEmbedding.from_dense: {type(dense).__name__} carries its own "
                                 "embed_scale; do not pass scale= as well")
            options["scale"] = scale
        unsupported = [n for n, bad in (("max_norm", dense.max_norm is not None),
                                        ("scale_grad_by_freq", dense.scale_grad_by_freq),
                                        ("sparse", dense.sparse)) if bad]
        if unsupported:
            raise ValueError(f"VocabParallelEmbedding.from_dense: nn.Embedding options {unsupported} are not supported")
        layer = cls(dense.num_embeddings, dense.embedding_dim, dense.padding_idx, group=group,
                    device="meta", dtype=dense.weight.dtype, **options)
        load_full_params(layer, {"weight": dense.weight}, like=dense)
        if layer.embed_scale is not None:  # built on meta above: the scale's value comes from the dense module
            layer.embed_scale = options["scale"].clone()
        return layer

    def to_dense(self) -> nn.Embedding:
        """The full ``nn.Embedding`` (a `ScaledEmbedding` when scaled; padding removed), gathered on
        every rank (collective)."""
        if self.embed_scale is None:
            dense = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx, device="meta")
        else:
            dense = ScaledEmbedding(self.num_embeddings, self.embedding_dim, self.padding_idx, device="meta",
                                    scale=self.embed_scale)
            dense.embed_scale = self.embed_scale.clone()
        dense.weight = new_param(self.gather_param("weight"), self.weight)
        return dense

    def extra_repr(self) -> str:
        scale = "" if self.embed_scale is None else f", scale={self.embed_scale.item():g}"
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}{scale}, "
                f"tp_size={self.group.size}, tp_rank={self.group.rank}, rows=[{self.vocab_start}, {self.vocab_end}), "
                f"sequence_parallel={self.sequence_parallel}")


class ParallelLMHead(_VocabParallelBase):
    """The output projection ``nn.Linear(dim, vocab, bias=bias)`` split along the vocabulary.

    Input ``(..., dim)`` replicated (``(..., seq/p, dim)`` with ``sequence_parallel``). Output:
    this rank's logits shard ``(..., [seq,] vocab_padded/p)``, whose padding columns are zero;
    ``bias=True``: a ``(vocab_padded/p,)`` bias, the same rows as the weight (padding entries zero);
    pass ``vocab_size=head.num_embeddings`` to `vocab_parallel_cross_entropy`. With
    ``gather_output=True``: the full ``(..., vocab)`` logits on every rank, padding removed.

    Tied embeddings (GPT-2 style): the local weight has the same layout as a
    `VocabParallelEmbedding` of the same vocabulary, so ``head.weight = embedding.weight`` ties
    them rank by rank, and both uses accumulate into the one gradient.
    ``siblings``: as :class:`~tplayers.layers.linear.ColumnParallelLinear`'s (the head after a norm that gathers
    the sequence for it takes the sequence-parallel path on the norm's shard offered through its set's inputs).
    """

    siblings: Optional[Siblings] = None
    tp_invariant = False  # as ColumnParallelLinear's

    def __init__(
        self,
        embedding_dim: int,
        num_embeddings: int,
        *,
        bias: bool = False,
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
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_rank, device=device, dtype=dtype))  # (V'/p,)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    @property
    def in_features(self) -> int:
        return self.embedding_dim

    @property
    def out_features(self) -> int:
        return self.num_embeddings

    def reset_parameters(self) -> None:
        """Redraw the full ``nn.Linear(dim, vocab, bias=...)`` init and keep this rank's rows."""
        full, bias = dense_linear_init(self.embedding_dim, self.num_embeddings, self.bias is not None,
                                       self.weight.device, self.weight.dtype)
        load_full_params(self, {"weight": full, "bias": bias})

    def param_placements(self) -> Dict[str, Placement]:
        rows = self.placement  # the bias follows the weight rows, padding included
        return {"weight": rows} if self.bias is None else {"weight": rows, "bias": rows}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # padding rows: zero weight and zero bias, so their logits are zero with or without a bias
        if self.tp_invariant:
            refuse_with_invariant(self)
            logits = invariant_column_linear(x, self.weight, self.bias, self.group,  # (..., V'/p)
                                             sequence_parallel=self.sequence_parallel, siblings=self.siblings)
        else:
            logits = column_parallel_linear(x, self.weight, self.bias, group=self.group,  # (..., V'/p)
                                            sequence_parallel=self.sequence_parallel, overlap_comm=self.overlap_comm,
                                            siblings=self.siblings)
        if not self.gather_output:
            return logits
        return gather_from_tp(logits, group=self.group)[..., : self.num_embeddings]  # (..., V)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "ParallelLMHead":
        """This rank's rows (weight and bias, if any) of an existing ``nn.Linear(dim, vocab)``."""
        if not isinstance(dense, nn.Linear):
            raise TypeError(f"ParallelLMHead.from_dense expects an nn.Linear, got {class_name(dense)}")
        if "bias" in options:
            raise ValueError("ParallelLMHead.from_dense: the bias comes from the dense nn.Linear; do not pass bias=")
        layer = cls(dense.in_features, dense.out_features, bias=dense.bias is not None, group=group, device="meta",
                    dtype=dense.weight.dtype, **options)
        load_full_params(layer, {"weight": dense.weight, "bias": dense.bias}, like=dense)
        return layer

    def to_dense(self) -> nn.Linear:
        """The full ``nn.Linear(dim, vocab)`` with its bias, if any (padding removed), on every rank
        (collective)."""
        return linear_to_dense(self)

    def extra_repr(self) -> str:
        return (f"embedding_dim={self.embedding_dim}, vocab={self.num_embeddings}, bias={self.bias is not None}, "
                f"tp_size={self.group.size}, tp_rank={self.group.rank}, rows=[{self.vocab_start}, {self.vocab_end}), "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")
