"""Plain-torch dense reference modules: what every tplayers block computes, on one device.

`ParallelMLP.to_dense()` returns a `DenseMLP`, `ParallelAttention.to_dense()` a
`DenseAttention`, and so on; parameter names are identical, so `assert_matches_dense` and
checkpoints match them one to one. Read these first: the parallel modules compute exactly this.

Conventions: activations ``(batch, seq, hidden)``; fused projections store their components
back to back (``qkv``: q heads, then k heads, then v heads; SwiGLU ``fc1``: gate, then up).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange, repeat

from ..layers.norm import make_norm
from .cache import KVCache, LayerKV, greedy_decode

__all__ = [
    "BlockConfig",
    "GPTConfig",
    "DenseMLP",
    "DenseAttention",
    "DenseTransformerBlock",
    "DenseGPT",
    "make_norm",
    "rotary_cos_sin",
    "apply_rotary",
    "attention_core",
    "normalize_attn_mask",
    "rotate_and_cache",
]

ACTIVATIONS = ("gelu", "swiglu")


@dataclass
class BlockConfig:
    """One pre-norm transformer block. ``n_kv_heads`` < ``n_heads`` is grouped-query attention."""

    hidden: int
    n_heads: int
    ffn_hidden: int
    n_kv_heads: Optional[int] = None  # None: = n_heads (multi-head attention)
    head_dim: Optional[int] = None  # None: hidden // n_heads
    activation: str = "gelu"  # "gelu" | "swiglu"
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    bias: bool = True
    causal: bool = True
    rotary: bool = False
    rope_theta: float = 10000.0
    dropout: float = 0.0  # on each residual branch
    attn_dropout: float = 0.0  # on the attention probabilities


@dataclass
class GPTConfig(BlockConfig):
    """A GPT: token embedding, ``n_layers`` blocks, final norm, untied LM head. Positions come
    from rotary embeddings (no learned position table)."""

    vocab_size: int = 256
    n_layers: int = 2
    rotary: bool = True


def _check_choice(value: str, choices: Tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise ValueError(f"{what} must be one of {choices}, got {value!r}")


# ---------------------------------------------------------------------------- MLP


class DenseMLP(nn.Module):
    """``fc2(act(fc1(x)))``; SwiGLU: ``fc1`` is the fused ``[gate; up]``, ``fc2(silu(gate) * up)``."""

    def __init__(self, hidden: int, ffn_hidden: int, activation: str = "gelu", bias: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        _check_choice(activation, ACTIVATIONS, "activation")
        self.hidden, self.ffn_hidden, self.activation = hidden, ffn_hidden, activation
        n_fc1 = 2 * ffn_hidden if activation == "swiglu" else ffn_hidden
        self.fc1 = nn.Linear(hidden, n_fc1, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # (..., ffn) | (..., 2*ffn)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.fc2(h)  # (..., hidden)


# ---------------------------------------------------------------------------- attention


def rotary_cos_sin(seq: int, head_dim: int, theta: float, device: Any, dtype: torch.dtype):
    """cos, sin ``(seq, head_dim)`` for rotary position embeddings (rotate-half convention)."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=work) / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=work), inv_freq)  # (s, d/2)
    angles = torch.cat([angles, angles], dim=-1)  # (s, d)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(b, h, s, d)`` by the per-position angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rotate_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rotary: bool, theta: float,
                     cache: Optional[LayerKV]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotary angles at the new positions (they start at the cached length), then the cached keys
    and values put before the new ones: ``q (b, hq, s, d)``, ``k, v (b, hkv, t + s, d)``."""
    offset = 0 if cache is None else cache.offset
    if rotary:
        s, hd = q.shape[-2], q.shape[-1]
        cos, sin = rotary_cos_sin(offset + s, hd, theta, q.device, q.dtype)
        q, k = apply_rotary(q, cos[offset:], sin[offset:]), apply_rotary(k, cos[offset:], sin[offset:])
    if cache is not None:
        k, v = cache.append(k, v)
    return q, k, v


def refuse_mask_with_cache(attn_mask: Optional[torch.Tensor], cache: Optional[LayerKV], layer: str) -> None:
    if attn_mask is not None and cache is not None:
        raise ValueError(f"{layer}: attn_mask together with a KV cache is not supported (decoding is causal "
                         "over the cached positions); pass one or the other")


def normalize_attn_mask(mask: Optional[torch.Tensor], batch: int, seq: int, n_heads: int, layer: str) -> Optional[torch.Tensor]:
    """A user mask as ``(b | 1, 1 | n_heads, 1 | s, s)`` (query dim 1: a key-padding mask, broadcast
    over the queries). Bool: True = attend; float: added to scores."""
    if mask is None:
        return None
    if mask.dtype != torch.bool and not mask.is_floating_point():
        # an integer 0/1 mask would be added to the scores as a bias: SDPA refuses it, and so do we
        raise TypeError(f"{layer}: attn_mask must be bool (True = attend) or floating point (added to the "
                        f"scores), got {mask.dtype}")
    if mask.dim() == 2:
        mask = mask[None, None]
    elif mask.dim() == 3:
        mask = mask[:, None]
    ok = (mask.dim() == 4 and mask.shape[-1] == seq and mask.shape[-2] in (1, seq) and mask.shape[0] in (1, batch)
          and mask.shape[1] in (1, n_heads))
    if not ok:
        raise ValueError(
            f"{layer}: attn_mask of shape {tuple(mask.shape)} does not fit batch={batch}, heads={n_heads}, "
            f"seq={seq}: expected (s, s), (b, s, s) or (b | 1, 1 | heads, 1 | s, s)")
    return mask


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                   attn_mask: Optional[torch.Tensor], dropout_p: float) -> torch.Tensor:
    """SDPA over ``q (b, hq, s, d)`` and ``k, v (b, hkv, t, d)`` (``t > s``: keys of cached positions
    first); query head i reads KV head ``i // (hq // hkv)``. A causal flag and a mask are combined
    into one mask."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = repeat(k, "b h s d -> b (h g) s d", g=groups)
        v = repeat(v, "b h s d -> b (h g) s d", g=groups)
    s, t = q.shape[-2], k.shape[-2]  # t > s: cached keys come first, query i sits at position t - s + i
    if causal and (attn_mask is not None or t != s):
        allowed = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
        if attn_mask is None:
            attn_mask = allowed
        elif attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & allowed
        else:
            attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
        causal = False
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal)


def check_heads(hidden: int, n_heads: int, n_kv_heads: Optional[int], head_dim: Optional[int], layer: str):
    """(n_kv_heads, head_dim) resolved, or a ValueError naming what does not fit."""
    if n_heads < 1:
        raise ValueError(f"{layer}: n_heads={n_heads} must be positive")
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"{layer}: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    if head_dim is None:
        if hidden % n_heads:
            raise ValueError(f"{layer}: hidden={hidden} is not divisible by n_heads={n_heads} (pass head_dim)")
        head_dim = hidden // n_heads
    return n_kv_heads, head_dim


class DenseAttention(nn.Module):
    """Self-attention with a fused ``qkv`` projection ``[q heads; k heads; v heads]`` and ``proj``."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                 bias: bool = True, causal: bool = True, rotary: bool = False, rope_theta: float = 10000.0,
                 attn_dropout: float = 0.0, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.n_kv_heads, self.head_dim = check_heads(hidden, n_heads, n_kv_heads, head_dim, type(self).__name__)
        self.hidden, self.n_heads = hidden, n_heads
        self.causal, self.rotary, self.rope_theta, self.attn_dropout = causal, rotary, rope_theta, attn_dropout
        if rotary and self.head_dim % 2:
            raise ValueError(f"{type(self).__name__}: rotary embeddings need an even head_dim, got {self.head_dim}")
        q_size, kv_size = n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.qkv = nn.Linear(hidden, q_size + 2 * kv_size, bias=bias, device=device, dtype=dtype)
        self.proj = nn.Linear(q_size, hidden, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                cache: Optional[LayerKV] = None) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"{type(self).__name__}: expected input (batch, seq, hidden), got {tuple(x.shape)}")
        refuse_mask_with_cache(attn_mask, cache, type(self).__name__)
        b, s, _ = x.shape
        hd = self.head_dim
        q, k, v = self.qkv(x).split([self.n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd], dim=-1)
        q, k, v = (rearrange(t, "b s (h d) -> b h s d", d=hd) for t in (q, k, v))
        q, k, v = rotate_and_cache(q, k, v, rotary=self.rotary, theta=self.rope_theta, cache=cache)
        mask = normalize_attn_mask(attn_mask, b, s, self.n_heads, type(self).__name__)
        o = attention_core(q, k, v, causal=self.causal, attn_mask=mask,
                           dropout_p=self.attn_dropout if self.training else 0.0)  # (b, h, s, d)
        return self.proj(rearrange(o, "b h s d -> b s (h d)"))


# ---------------------------------------------------------------------------- block and GPT


class DenseTransformerBlock(nn.Module):
    """Pre-norm block: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``."""

    def __init__(self, config: BlockConfig, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        c = self.config = config
        self.attn_norm = make_norm(c.norm, c.hidden, c.norm_eps, c.bias, device, dtype)
        self.attn = DenseAttention(c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.bias, c.causal, c.rotary,
                                   c.rope_theta, c.attn_dropout, device=device, dtype=dtype)
        self.mlp_norm = make_norm(c.norm, c.hidden, c.norm_eps, c.bias, device, dtype)
        self.mlp = DenseMLP(c.hidden, c.ffn_hidden, c.activation, c.bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                cache: Optional[LayerKV] = None) -> torch.Tensor:
        p = self.config.dropout if self.training else 0.0
        x = x + F.dropout(self.attn(self.attn_norm(x), attn_mask, cache), p)
        return x + F.dropout(self.mlp(self.mlp_norm(x)), p)


class DenseGPT(nn.Module):
    """``head(norm(blocks(embed(ids))))``: logits ``(b, s, vocab)`` from ids ``(b, s)``."""

    def __init__(self, config: GPTConfig, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        c = self.config = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(DenseTransformerBlock(c, device, dtype) for _ in range(c.n_layers))
        self.norm = make_norm(c.norm, c.hidden, c.norm_eps, c.bias, device, dtype)
        self.head = nn.Linear(c.hidden, c.vocab_size, bias=False, device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        x = F.dropout(self.embed(ids), self.config.dropout if self.training else 0.0)  # (b, s, h)
        for i, block in enumerate(self.blocks):
            x = block(x, attn_mask, None if cache is None else cache.layers[i])
        return self.head(self.norm(x))  # (b, s, vocab)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding with a KV cache: ``ids (b, s) -> (b, s + max_new_tokens)``."""
        return greedy_decode(lambda new, cache: self(new, cache=cache), ids, len(self.blocks), max_new_tokens)

    def loss(self, ids: torch.Tensor, targets: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
             ignore_index: int = -100) -> torch.Tensor:
        logits = self(ids, attn_mask)
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index)
