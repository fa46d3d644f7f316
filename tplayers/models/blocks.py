"""Transformer blocks from TP layers: ParallelMLP, ParallelAttention, ParallelTransformerBlock.

Megatron's recipe: each sublayer enters its TP region through a column-parallel linear (its
output features split across ranks) and leaves it through a row-parallel linear (partial sums
all-reduced), so one sublayer costs one all-reduce forward and one backward.

With ``sequence_parallel=True`` the activations *between* TP regions (norms, dropout,
residuals) are split along the sequence dim: ``(b, s/p, h)`` on each rank. The column linear
all-gathers its input shard and the row linear reduce-scatters its output, the same bytes
as the all-reduce, while norms and dropout work on 1/p of the tokens. Norm weights then see
only this rank's tokens, and `ParallelNorm` all-reduces their gradients.

Every module converts both ways with its plain-torch twin in `tplayers.models.dense`
(``from_dense`` / ``to_dense``), with identical parameter names.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from .activation import Activation
from .cache import LayerKV
from .dense import (ACTIVATIONS, BlockConfig, DenseAttention, DenseMLP, DenseTransformerBlock, attention_core,
                    check_heads, normalize_attn_mask, refuse_mask_with_cache, rotate_and_cache)
from ..regions.region import require_chunks, split_backward_region
from ..core.functional import autocast_dtype
from ..regions.interleave import ResidualRegion, interleaved_residual_regions
from ..layers.fused import FusedColumnParallelLinear
from ..core.groups import GroupLike, resolve_group
from ..core.placement import kv_shards as placement_kv_shards, require_divisible, require_positive
from ..layers.base import TensorParallelModule, has_module_hooks
from ..layers.linear import ColumnParallelLinear, RowParallelLinear, grad_sinks
from ..layers.norm import ParallelNorm
from .rng import PARALLEL, RNGTracker, activation_dropout, dropout_context, require_rng

__all__ = ["ParallelMLP", "ParallelAttention", "ParallelTransformerBlock"]


# ---------------------------------------------------------------------------- MLP


def region_sinks(column: nn.Module, row: nn.Module, ring: bool = False) -> Optional[Dict[str, Any]]:
    """Where a fused column -> row region sends its weight gradients (``wgrad_store`` / ``main_grads``
    of `split_backward_region`), or None when the two layers disagree (then run them separately). ``ring``: the
    caller runs the region unchunked, where collective matmul's ring steps may be (it has no chunked form)."""
    if column.delay_wgrad != row.delay_wgrad or column.accumulate_main_grad != row.accumulate_main_grad:
        return None
    if column.collective_matmul != row.collective_matmul or column.collective_matmul and not ring:
        return None
    col, r = grad_sinks(column), grad_sinks(row)
    main = None if col["main_grads"] is None else (*col["main_grads"], *r["main_grads"])
    return {"wgrad_store": col["wgrad_store"], "main_grads": main}



class ParallelMLP(TensorParallelModule):
    """``fc2(act(fc1(x)))``: ``fc1`` column-parallel, ``fc2`` row-parallel (as `DenseMLP`).

    SwiGLU: ``fc1`` is the fused ``[gate; up]``, gate and up each split across ranks, so rank r
    computes ``silu(gate_r) * up_r`` locally. ``ffn_hidden`` must divide the TP degree.
    ``split_backward``: one fused backward (`tplayers.regions.region.parallel_mlp`) runs fc1's
    input-gradient collective under both layers' weight gradients instead of fc1's alone; the
    same numbers, bit for bit (off with ``overlap_comm=False``).
    ``chunks`` > 1: the same fused region, run over that many batch chunks so each chunk's fc2
    collective travels while the next chunk computes (forward overlap, Domino-style) and each
    chunk's fc1 input-gradient collective while the backward goes on; equal up to rounding.
    Under sequence parallelism the tokens stay in the gathered, rank-major order from fc1's GEMM to fc2's in every
    schedule (`tplayers.regions.region.keeps_rank_major`; the Megatron schedule, overlap off and collective matmul
    as one region in the two layers' own order: `_keeps_rank_major`), so nothing between the two GEMMs is ever
    reordered: the two layers' bits where fc1's output and fc2's input are the narrow sides (TP 8 on Llama-3
    widths), else equal to rounding. ``tp_invariant``, hooks registered on fc1 or fc2 and a ``torch.compile``
    graph take the two layers as they are (global module hooks see the MLP's call, not fc1's and fc2's).
    Input/output ``(..., hidden)``; ``(..., seq/p, hidden)`` with ``sequence_parallel``.
    """

    def __init__(self, hidden: int, ffn_hidden: int, activation: str = "gelu", bias: bool = True, *,
                 group: GroupLike, sequence_parallel: bool = False, overlap_comm: bool = True,
                 split_backward: bool = False, chunks: int = 1, device: Any = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.split_backward, self.chunks = split_backward, require_chunks(chunks, "ParallelMLP")
        if activation not in ACTIVATIONS:
            raise ValueError(f"ParallelMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.group = resolve_group(group)
        require_positive(hidden, "ParallelMLP", "hidden")
        require_divisible(ffn_hidden, self.group.size, "ParallelMLP", "ffn_hidden")
        self.hidden, self.ffn_hidden, self.activation = hidden, ffn_hidden, activation
        self.sequence_parallel = sequence_parallel
        common = dict(group=self.group, sequence_parallel=sequence_parallel, overlap_comm=overlap_comm,
                      device=device, dtype=dtype)
        if activation == "swiglu":
            self.fc1: nn.Module = FusedColumnParallelLinear(hidden, [ffn_hidden, ffn_hidden], bias,
                                                            part_names=["gate", "up"], layer="ParallelMLP.fc1",
                                                            **common)
        else:
            self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, bias, **common)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, bias, input_is_parallel=True, **common)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        return Activation(self.activation)(h)

    def _region(self, split: bool) -> Optional[Dict[str, Any]]:
        """`split_backward_region`'s arguments for this MLP, or None when its two layers must run separately
        (``split``: the split backward, else the two layers' order). The activation is recomputed in backward: its
        output is not kept, and a nested backward through a graph kept from forward would, under activation
        checkpointing, run the checkpointed forward a second time."""
        sinks = region_sinks(self.fc1, self.fc2, ring=not split)
        if sinks is None:
            return None
        return dict(w1=self.fc1.weight, b1=self.fc1.bias, w2=self.fc2.weight, b2=self.fc2.bias,
                    core=Activation(self.activation), recompute=True, token_wise=True, **sinks)

    def _keeps_rank_major(self) -> bool:
        """Whether the two layers run as one region in their own order, only to keep the tokens rank-major between
        them (under SP: `keeps_rank_major`): not where fc1's output or fc2's input is observed (a module hook),
        computed another way (``tp_invariant``) or traced (compile)."""
        fc1, fc2 = self.fc1, self.fc2
        return (self.group.size > 1 and self.sequence_parallel
                and not (fc1.tp_invariant or fc2.tp_invariant or has_module_hooks(fc1) or has_module_hooks(fc2))
                and not torch.compiler.is_compiling())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        overlap = self.fc1.overlap_comm
        split = self.chunks > 1 or self.split_backward and overlap
        region = self._region(split) if split or self._keeps_rank_major() else None
        if region is not None:  # split: both weight gradients under fc1's collective; else the two layers' order
            return split_backward_region(x, **region, group=self.group, sequence_parallel=self.sequence_parallel,
                                         overlap_comm=overlap, chunks=self.chunks, split_backward=split,
                                         collective_matmul=not split and self.fc1.collective_matmul)
        return self.fc2(self._act(self.fc1(x)))  # (..., s, ffn/p | 2*ffn/p) -> (..., [s or s/p], hidden)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "ParallelMLP":
        if not isinstance(dense, DenseMLP):
            raise TypeError(f"ParallelMLP.from_dense expects a tplayers.models.dense.DenseMLP, got {type(dense).__name__}")
        w = dense.fc1.weight
        mlp = cls(dense.hidden, dense.ffn_hidden, dense.activation, dense.fc1.bias is not None, group=group,
                  device="meta", dtype=w.dtype, **options)
        if dense.activation == "swiglu":
            mlp.fc1 = FusedColumnParallelLinear.from_dense(
                dense.fc1, group=mlp.group, parts=[dense.ffn_hidden] * 2, part_names=["gate", "up"],
                layer="ParallelMLP.fc1", sequence_parallel=mlp.sequence_parallel, overlap_comm=mlp.fc2.overlap_comm)
        else:
            mlp.fc1 = ColumnParallelLinear.from_dense(dense.fc1, group=mlp.group, sequence_parallel=mlp.sequence_parallel,
                                                      overlap_comm=mlp.fc2.overlap_comm)
        mlp.fc2 = RowParallelLinear.from_dense(dense.fc2, group=mlp.group, sequence_parallel=mlp.sequence_parallel,
                                               overlap_comm=mlp.fc2.overlap_comm)
        return mlp

    def to_dense(self) -> DenseMLP:
        dense = DenseMLP(self.hidden, self.ffn_hidden, self.activation, self.fc2.bias is not None, device="meta")
        dense.fc1, dense.fc2 = self.fc1.to_dense(), self.fc2.to_dense()
        return dense



# ---------------------------------------------------------------------------- attention


class ParallelAttention(TensorParallelModule):
    """Self-attention with the heads split across ranks (as `DenseAttention`).

    ``qkv`` is a fused column-parallel linear whose q, k and v components are each split by
    heads; ``proj`` is row-parallel. Grouped-query attention: with ``n_kv_heads >= p`` each rank
    holds ``n_kv_heads/p`` KV heads; with fewer KV heads than ranks each KV head is replicated on
    the ``p/n_kv_heads`` ranks whose query heads read it (its weight gradient is summed over
    them). ``n_heads`` and ``n_kv_heads`` must fit the TP degree (a clear error otherwise).

    Input ``(b, s, hidden)``; ``(b, s/p, hidden)`` with ``sequence_parallel`` (attention itself
    always sees the whole sequence). ``attn_mask``: bool (True = attend) or additive float,
    ``(s, s)``, ``(b, s, s)`` or ``(b | 1, 1 | n_heads, 1 | s, s)`` (query dim 1: a key-padding
    mask); combined with ``causal``.
    Attention dropout runs on this rank's heads, under ``rng``'s parallel stream.
    ``split_backward``: as `ParallelMLP`'s, qkv's input-gradient collective runs under both qkv's and
    proj's weight gradients (the attention graph from forward is kept, nothing recomputed); not with
    a KV cache or attention dropout in training (those take the two-layer path). ``chunks`` > 1:
    the same region over batch chunks, as `ParallelMLP`'s (a per-example mask follows its rows).
    """

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                 bias: bool = True, *, group: GroupLike, causal: bool = True, rotary: bool = False,
                 rope_theta: float = 10000.0, attn_dropout: float = 0.0, rng: Optional[RNGTracker] = None,
                 sequence_parallel: bool = False, overlap_comm: bool = True, split_backward: bool = False,
                 chunks: int = 1, device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        name = "ParallelAttention"
        self.split_backward, self.chunks = split_backward, require_chunks(chunks, name)
        self.group = tp = resolve_group(group)
        self.n_kv_heads, self.head_dim = check_heads(hidden, n_heads, n_kv_heads, head_dim, name)
        require_divisible(n_heads, tp.size, name, "n_heads")
        kv_shards = placement_kv_shards(self.n_kv_heads, tp.size, name)
        if rotary and self.head_dim % 2:
            raise ValueError(f"{name}: rotary embeddings need an even head_dim, got {self.head_dim}")
        require_rng(rng, tp, name, "attn_dropout", attn_dropout)
        self.hidden, self.n_heads = hidden, n_heads
        self.local_heads, self.local_kv_heads = n_heads // tp.size, self.n_kv_heads // kv_shards
        self.causal, self.rotary, self.rope_theta, self.attn_dropout = causal, rotary, rope_theta, attn_dropout
        self.rng, self.sequence_parallel = rng, sequence_parallel
        q_size, kv_size = n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        common = dict(group=tp, sequence_parallel=sequence_parallel, overlap_comm=overlap_comm, device=device, dtype=dtype)
        self.qkv = FusedColumnParallelLinear(hidden, [q_size, kv_size, kv_size], bias, part_shards=[tp.size, kv_shards, kv_shards],
                                             part_names=["q", "k", "v"], layer=f"{name}.qkv", **common)
        self.proj = RowParallelLinear(q_size, hidden, bias, input_is_parallel=True, **common)

    def _local_mask(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor],
                    cache: Optional[LayerKV]) -> Optional[torch.Tensor]:
        """``attn_mask`` checked and normalized to ``(b | 1, this rank's heads | 1, 1 | s, s)``."""
        if x.dim() != 3:
            raise ValueError(f"ParallelAttention: expected input (batch, seq, hidden), got {tuple(x.shape)}")
        refuse_mask_with_cache(attn_mask, cache, "ParallelAttention")
        b, s = x.shape[0], x.shape[1] * (self.group.size if self.sequence_parallel else 1)  # the whole sequence
        mask = normalize_attn_mask(attn_mask, b, s, self.n_heads, "ParallelAttention")
        if mask is not None and mask.shape[1] > 1:  # per-head mask: this rank's heads
            mask = mask.narrow(1, self.group.rank * self.local_heads, self.local_heads)
        return mask

    def _region(self, mask: Optional[torch.Tensor]) -> Optional[Dict[str, Any]]:
        """`split_backward_region`'s arguments for this attention (no dropout, no cache), or None when
        qkv and proj must run separately."""
        sinks = region_sinks(self.qkv, self.proj)
        if sinks is None:
            return None
        qkv = self.qkv

        def core(h: torch.Tensor, rows: slice) -> torch.Tensor:  # a per-example mask follows the batch chunk
            return self._core(h, mask if mask is None or mask.shape[0] == 1 else mask[rows], None, 0.0)

        return dict(w1=qkv._with_replica_grads(qkv.weight), b1=None if qkv.bias is None else qkv._with_replica_grads(qkv.bias),
                    w2=self.proj.weight, b2=self.proj.bias, core=core, recompute=False, **sinks)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                cache: Optional[LayerKV] = None) -> torch.Tensor:
        mask = self._local_mask(x, attn_mask, cache)
        p = self.attn_dropout if self.training else 0.0
        overlap = self.qkv.overlap_comm
        split = (self.chunks > 1 or self.split_backward and overlap) and cache is None and p == 0
        region = self._region(mask) if split else None
        if region is not None:  # qkv's input-gradient collective under both qkv's and proj's weight gradients
            return split_backward_region(x, **region, group=self.group, sequence_parallel=self.sequence_parallel,
                                         overlap_comm=overlap, chunks=self.chunks)
        return self.proj(self._core(self.qkv(x), mask, cache, p))  # (b, s | s/p, hidden)

    def _core(self, qkv: torch.Tensor, mask: Optional[torch.Tensor], cache: Optional[LayerKV],
              p: float) -> torch.Tensor:
        """``(b, s, (hq/p + 2*hkv_local) * d)`` -> ``(b, s, hq/p * d)``: this rank's heads, the whole sequence."""
        hd = self.head_dim
        q, k, v = qkv.split([self.local_heads * hd, self.local_kv_heads * hd, self.local_kv_heads * hd], dim=-1)
        q, k, v = (rearrange(t, "b s (h d) -> b h s d", d=hd) for t in (q, k, v))
        q, k, v = rotate_and_cache(q, k, v, rotary=self.rotary, theta=self.rope_theta, cache=cache)  # cache: local KV heads
        with dropout_context(self.rng if p > 0 else None, PARALLEL, qkv.device):
            o = attention_core(q, k, v, causal=self.causal, attn_mask=mask, dropout_p=p)  # (b, hq/p, s, d)
        return rearrange(o, "b h s d -> b s (h d)")

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "ParallelAttention":
        if not isinstance(dense, DenseAttention):
            raise TypeError(f"ParallelAttention.from_dense expects a tplayers.models.dense.DenseAttention, got {type(dense).__name__}")
        attn = cls(dense.hidden, dense.n_heads, dense.n_kv_heads, dense.head_dim, dense.qkv.bias is not None,
                   group=group, causal=dense.causal, rotary=dense.rotary, rope_theta=dense.rope_theta,
                   attn_dropout=dense.attn_dropout, device="meta", dtype=dense.qkv.weight.dtype, **options)
        q = attn.qkv
        attn.qkv = FusedColumnParallelLinear.from_dense(
            dense.qkv, group=attn.group, parts=q.parts, part_shards=q.part_shards, part_names=["q", "k", "v"],
            layer=q.layer, sequence_parallel=q.sequence_parallel, overlap_comm=q.overlap_comm)
        attn.proj = RowParallelLinear.from_dense(dense.proj, group=attn.group, sequence_parallel=attn.sequence_parallel,
                                                 overlap_comm=q.overlap_comm)
        return attn

    def to_dense(self) -> DenseAttention:
        dense = DenseAttention(self.hidden, self.n_heads, self.n_kv_heads, self.head_dim, self.proj.bias is not None,
                               self.causal, self.rotary, self.rope_theta, self.attn_dropout, device="meta")
        dense.qkv, dense.proj = self.qkv.to_dense(), self.proj.to_dense()
        return dense


    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"local_heads={self.local_heads}, local_kv_heads={self.local_kv_heads}, causal={self.causal}, "
                f"rotary={self.rotary}")


# ---------------------------------------------------------------------------- block


class ParallelTransformerBlock(TensorParallelModule):
    """Pre-norm block (as `DenseTransformerBlock`): ``x + drop(attn(norm(x)))``, then
    ``x + drop(mlp(norm(x)))``, with attention and MLP tensor-parallel.

    Input/output ``(b, s, hidden)`` replicated, or ``(b, s/p, hidden)`` with
    ``sequence_parallel`` (this rank's sequence chunk, e.g. from `tplayers.core.comm.scatter_to_sequence`).
    Residual dropout is replicated without sequence parallelism and per-shard with it; any
    dropout at TP > 1 needs ``rng``.

    Batch chunks (``set_overlap(block, chunks=k)``: attention and MLP with the same ``chunks``): with
    ``interleave_chunks`` (the default) the whole block runs as one pipeline over the chunks
    (`tplayers.regions.interleave`), so the attention's last chunk collective travels under the MLP's
    first chunk instead of waiting alone; ``False`` chunks each sublayer on its own. Without dropout
    in training, a KV cache or sequence parallelism; otherwise (and in a world of one, or under
    autocast) the sublayers run one after the other, each with its own chunks.
    """

    def __init__(self, config: BlockConfig, *, group: GroupLike, sequence_parallel: bool = False,
                 rng: Optional[RNGTracker] = None, overlap_comm: bool = True, interleave_chunks: bool = True,
                 device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        c = self.config = config
        self.interleave_chunks = interleave_chunks
        self.group = tp = resolve_group(group)
        require_rng(rng, tp, "ParallelTransformerBlock", "dropout", c.dropout)
        self.rng, self.sequence_parallel = rng, sequence_parallel
        norm = dict(group=tp, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        linear = dict(group=tp, sequence_parallel=sequence_parallel, overlap_comm=overlap_comm, device=device, dtype=dtype)
        self.attn_norm = ParallelNorm(c.hidden, c.norm, c.norm_eps, c.bias, **norm)
        self.attn = ParallelAttention(c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.bias, causal=c.causal,
                                      rotary=c.rotary, rope_theta=c.rope_theta, attn_dropout=c.attn_dropout,
                                      rng=rng, **linear)
        self.mlp_norm = ParallelNorm(c.hidden, c.norm, c.norm_eps, c.bias, **norm)
        self.mlp = ParallelMLP(c.hidden, c.ffn_hidden, c.activation, c.bias, **linear)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return activation_dropout(x, self.config.dropout if self.training else 0.0, self.rng, self.sequence_parallel)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                cache: Optional[LayerKV] = None) -> torch.Tensor:
        if self._interleaves(x, cache):
            out = self._interleaved(x, attn_mask)
            if out is not None:
                return out
        x = x + self._dropout(self.attn(self.attn_norm(x), attn_mask, cache))  # (b, s | s/p, h)
        return x + self._dropout(self.mlp(self.mlp_norm(x)))

    def _interleaves(self, x: torch.Tensor, cache: Optional[LayerKV]) -> bool:
        """Whether the block runs as one pipeline over batch chunks (anything unusual about ``x`` takes
        the sublayer path, whose checks name it)."""
        attn, mlp, c = self.attn, self.mlp, self.config
        weight = attn.qkv.weight
        # Not under sequence parallelism: each stage's all-gather would queue behind the previous chunks'
        # reduce-scatters on an in-order link and wait for them (measured slower than the sublayer path)
        return (self.interleave_chunks and attn.chunks > 1 and attn.chunks == mlp.chunks and cache is None
                and not self.sequence_parallel
                and not (self.training and (c.dropout > 0 or c.attn_dropout > 0)) and self.group.size > 1
                and attn.qkv.overlap_comm == mlp.fc1.overlap_comm and x.dim() == 3 and x.shape[-1] == c.hidden
                and x.dtype == weight.dtype and x.device == weight.device and autocast_dtype(x) is None)

    def _interleaved(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The block over batch chunks as one pipeline, or None if a sublayer must run as two layers."""
        mlp_region = self.mlp._region(split=True)  # first: the attention's region adds the replica-gradient ops
        attn_region = None if mlp_region is None else self.attn._region(self.attn._local_mask(x, attn_mask, None))
        if attn_region is None:
            return None
        regions = [ResidualRegion(norm.normalize, norm.weight, norm.bias, **region)
                   for norm, region in ((self.attn_norm, attn_region), (self.mlp_norm, mlp_region))]
        return interleaved_residual_regions(x, regions, group=self.group, chunks=self.attn.chunks,
                                            sequence_parallel=self.sequence_parallel,
                                            overlap_comm=self.attn.qkv.overlap_comm)

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "ParallelTransformerBlock":
        if not isinstance(dense, DenseTransformerBlock):
            raise TypeError(f"ParallelTransformerBlock.from_dense expects a DenseTransformerBlock, got {type(dense).__name__}")
        tp = resolve_group(group)
        block = cls(dense.config, group=tp, device="meta", dtype=dense.attn.qkv.weight.dtype, **options)
        sp = dict(sequence_parallel=block.sequence_parallel)
        block.attn_norm = ParallelNorm.from_dense(dense.attn_norm, group=tp, **sp)
        block.mlp_norm = ParallelNorm.from_dense(dense.mlp_norm, group=tp, **sp)
        overlap = block.mlp.fc2.overlap_comm
        block.attn = ParallelAttention.from_dense(dense.attn, group=tp, rng=block.rng, overlap_comm=overlap, **sp)
        block.mlp = ParallelMLP.from_dense(dense.mlp, group=tp, overlap_comm=overlap, **sp)
        return block

    def to_dense(self) -> DenseTransformerBlock:
        dense = DenseTransformerBlock(self.config, device="meta")
        dense.attn_norm, dense.attn = self.attn_norm.to_dense(), self.attn.to_dense()
        dense.mlp_norm, dense.mlp = self.mlp_norm.to_dense(), self.mlp.to_dense()
        return dense

