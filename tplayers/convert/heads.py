"""Where an attention keeps its head counts (Hugging Face's config, or its own attributes), and reading an
attribute path (``"config.n_head"``) on a module.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch.nn as nn

__all__ = ["attention_heads", "getattr_path", "per_head_norms"]


def getattr_path(obj: Any, path: str) -> Any:
    """``obj.a.b.c`` for ``path="a.b.c"``, or an AttributeError naming the missing part."""
    value = obj
    for part in path.split("."):
        if not hasattr(value, part):
            raise AttributeError(f"{type(obj).__name__} has no attribute path '{path}' (no '{part}')")
        value = getattr(value, part)
    return value


# Where an attention keeps its head counts, first found wins: its config (never changed by parallelize), then
# its own attributes (Exaone 4, Seed-OSS, Nemotron keep num_key_value_heads / num_heads of their own).
_HEAD_COUNTS = ("config.num_attention_heads", "num_attention_heads", "num_heads")


_KV_HEAD_COUNTS = ("config.num_key_value_heads", "num_key_value_heads")


def _first_count(module: nn.Module, paths: Sequence[str]) -> Tuple[Optional[int], str]:
    """The first int found at ``paths`` on ``module`` and its path, or (None, "")."""
    for path in paths:
        try:
            value = getattr_path(module, path)
        except AttributeError:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            return value, path
    return None, ""


def head_counts(attn: nn.Module) -> Tuple[Optional[int], int, str]:
    """Query heads, KV heads and where the KV count was read ("" for multi-head: none kept)."""
    heads, _ = _first_count(attn, _HEAD_COUNTS)
    kv, where = _first_count(attn, _KV_HEAD_COUNTS)
    if kv is None and heads is None:
        raise AttributeError(f"{type(attn).__name__} has no attribute path 'config.num_key_value_heads' nor any other "
                             f"head count ({', '.join(_KV_HEAD_COUNTS[1:] + _HEAD_COUNTS)})")
    groups = getattr(attn, "num_key_value_groups", None)  # the attention's own: per layer where the config is not
    if (isinstance(groups, int) and not isinstance(groups, bool) and groups > 0 and heads and heads % groups == 0
            and heads // groups != (heads if kv is None else kv)):  # (MiMo-V2-Flash's sliding layers: twice the KV heads)
        return heads, heads // groups, "num_key_value_groups"
    if kv is None:
        return heads, heads, ""
    return heads, kv, where


def attention_heads(attn: nn.Module) -> Tuple[Optional[int], int]:
    """``(query heads, KV heads)`` of a dense attention module, read where Hugging Face attentions keep
    them (``config.num_attention_heads`` / ``config.num_key_value_heads``, else the attention's own
    ``num_attention_heads`` or ``num_heads`` / ``num_key_value_heads``). No KV count anywhere means plain
    multi-head attention: as many KV heads as heads (GPT-J). Query heads may be unknown (None) when only
    a KV count is found; neither raises an AttributeError naming where it looked."""
    heads, kv, _ = head_counts(attn)
    return heads, kv


_HEAD_NORMS = {"q_proj": ("q_norm", "q_layernorm", "query_layernorm"), "k_proj": ("k_norm", "k_layernorm", "key_layernorm")}


def per_head_norms(modules: Dict[str, nn.Module], projections: List[str], taken: Set[str]) -> List[str]:
    """The per-head q / k norms beside the split q / k ``projections`` that no entry in ``taken`` names (Qwen3-VL-MoE's,
    MiniMax-M2's plans miss them): a norm whose weight is one head's width acts on this rank's heads, so its gradients
    must be summed over the group. A norm over its projection's whole width (OLMo2's) is not per head: left alone."""
    found: List[str] = []
    for name in projections:
        parent, kind = name.rpartition(".")[0], name.rpartition(".")[2]
        width = getattr(modules.get(name), "out_features", None)
        for child in _HEAD_NORMS.get(kind, ()):
            norm, path = modules.get(f"{parent}.{child}"), f"{parent}.{child}"
            if norm is None or path in taken or path in found or not width:
                continue
            params = list(norm.parameters(recurse=False))
            if params and all(p.dim() == 1 and p.numel() < width and width % p.numel() == 0 for p in params):
                found.append(path)
    return found
