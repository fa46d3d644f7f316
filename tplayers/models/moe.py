"""A mixture-of-experts MLP: the dense spec (`DenseMoE`) and its tensor-parallel twin (`ParallelMoE`).

    router: logits = x @ W_r.T               (tokens, E)    replicated: every rank routes alike
    top-k:  weights, experts = topk(softmax(logits), k), weights renormalized to sum to 1
    experts[e](x) = (silu(x @ gate_e.T) * (x @ up_e.T)) @ down_e.T
    out[t] = sum over its k experts e of weights[t, e] * experts[e](x[t])

The experts keep Hugging Face's layout and call (``gate_up_proj (E, 2 * ffn, h)``, ``down_proj
(E, h, ffn)``, ``experts(x, top_k_index, top_k_weights)``, the id ``num_experts`` a sentinel that is
skipped), so `ParallelMoE` splits them with the same `ParallelExperts` that splits the Hugging Face
families': each expert's ffn across the ranks (``experts="ffn"``), or whole experts per rank
(``experts="whole"``), one all-reduce forward and one backward per MoE layer either way; or whole
experts per rank with each (token, expert) pair sent to its expert's rank and back
(``experts="all_to_all"``: two all-to-alls each way, :mod:`tplayers.layers.token_dispatch`), the one
layout for tokens that differ across ranks (``sequence_parallel=True``). The experts run as a loop
over the experts a batch routes to (torch has no grouped GEMM on every device and dtype). No token is
dropped (no capacity factor).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.comm import copy_to_tp
from ..core.groups import GroupLike, resolve_group
from ..core.placement import require_positive
from ..layers.base import TensorParallelModule
from ..layers.experts import ParallelExperts

__all__ = ["DenseExperts", "DenseMoE", "ParallelMoE"]


class DenseExperts(nn.Module):
    """``num_experts`` SwiGLU ffns as two 3-D parameters (Hugging Face's experts layout)."""

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        for what, value in (("hidden", hidden), ("ffn_hidden", ffn_hidden), ("num_experts", num_experts)):
            require_positive(value, "DenseExperts", what)
        self.num_experts, self.hidden, self.intermediate_dim = num_experts, hidden, ffn_hidden
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden, hidden, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden, device=device, dtype=dtype))
        for w, fan_in in ((self.gate_up_proj, hidden), (self.down_proj, ffn_hidden)):
            nn.init.uniform_(w, -fan_in ** -0.5, fan_in ** -0.5)  # nn.Linear's bound, per expert

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        # x (t, h); top_k_index, top_k_weights (t, k); an id equal to num_experts is skipped (another rank's)
        out = torch.zeros_like(x)
        for e in top_k_index.unique().tolist():
            if e >= self.num_experts:
                continue
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)  # (n, ffn) each
            y = F.linear(F.silu(gate) * up, self.down_proj[e])  # (n, h)
            out = out.index_add(0, token, y * top_k_weights[token, slot, None].to(y.dtype))
        return out


def _top_k(logits: torch.Tensor, k: int):
    probs = logits.softmax(dim=-1)  # (t, E)
    weights, index = probs.topk(k, dim=-1)
    return index, weights / weights.sum(dim=-1, keepdim=True)


class DenseMoE(nn.Module):
    """Top-``top_k`` routed SwiGLU experts (see the module docstring). Input/output ``(..., hidden)``."""

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int = 2, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"DenseMoE: top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)
        self.experts = DenseExperts(hidden, ffn_hidden, num_experts, device=device, dtype=dtype)

    def route(self, x: torch.Tensor):
        """(top_k_index, top_k_weights), each ``(tokens, top_k)``, for ``x (tokens, hidden)``."""
        return _top_k(self.router(x), self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (t, h)
        index, weights = self.route(flat)
        return self.experts(flat, index, weights).view_as(x)


class ParallelMoE(TensorParallelModule):
    """`DenseMoE` with its experts split across the TP group (`ParallelExperts`) and its router
    replicated. ``experts="ffn"`` (default): each expert's ffn split, the partial outputs summed by one
    all-reduce each way; ``"whole"``: ``num_experts / p`` whole experts per rank, summed the same way;
    ``"all_to_all"``: whole experts per rank, each routed token sent to its expert's rank and back (two
    all-to-alls each way instead of the all-reduce; tokens the same on every rank are split by rows first
    and the outputs all-gathered). Input/output ``(..., hidden)``: the same on every rank, or with
    ``sequence_parallel=True`` (``"all_to_all"`` only) this rank's own tokens (its sequence chunk), the
    dense twin's input being their concatenation; each rank then routes its own tokens and the router's
    gradient (a partial sum) is all-reduced backward. Built with :meth:`from_dense`."""

    def __init__(self, router: nn.Linear, experts: ParallelExperts, top_k: int, *, group: GroupLike,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.router, self.experts, self.top_k = router, experts, top_k
        self.sequence_parallel = sequence_parallel

    def route(self, x: torch.Tensor):
        """(top_k_index, top_k_weights), each ``(tokens, top_k)``, for ``x (tokens, hidden)``."""
        if not self.sequence_parallel:
            return DenseMoE.route(self, x)
        # this rank's tokens only: its gradient of the (replicated) router weights is a partial sum
        weight = copy_to_tp(self.router.weight, group=self.group)
        return _top_k(F.linear(x, weight, self.router.bias), self.top_k)

    forward = DenseMoE.forward

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, experts: str = "ffn", sequence_parallel: bool = False,
                   **options: Any) -> "ParallelMoE":
        if not isinstance(dense, DenseMoE):
            raise TypeError(f"ParallelMoE.from_dense expects a tplayers.models.moe.DenseMoE, got {type(dense).__name__}")
        if options:
            raise TypeError(f"ParallelMoE.from_dense: unknown options {sorted(options)}")
        if experts not in ("ffn", "whole", "all_to_all"):
            raise ValueError(f"ParallelMoE: experts={experts!r}; choose 'ffn', 'whole' or 'all_to_all'")
        if sequence_parallel and experts != "all_to_all":
            raise ValueError(f"ParallelMoE: sequence_parallel=True (each rank its own tokens) needs experts='all_to_all' "
                             f"(tokens sent to their experts' ranks); experts={experts!r} sums the partial outputs of the "
                             "same tokens on every rank")
        g = resolve_group(group)
        splits = ((("gate_up_proj", 1, 2), ("down_proj", 2, 1)) if experts == "ffn"
                  else (("gate_up_proj", 0, 1), ("down_proj", 0, 1)))
        try:
            tp_experts = ParallelExperts.from_dense(
                dense.experts, group=g, splits=splits, divide_attrs=("intermediate_dim",),
                dispatch="all_to_all" if experts == "all_to_all" else "all_reduce", sequence_parallel=sequence_parallel)
        except ValueError as e:
            raise ValueError(f"ParallelMoE (experts={experts!r}): {e}") from None
        return cls(copy.deepcopy(dense.router), tp_experts, dense.top_k, group=g,  # the router: whole on every rank
                   sequence_parallel=sequence_parallel)

    def to_dense(self) -> DenseMoE:
        experts = self.experts.to_dense()
        dense = DenseMoE(self.router.in_features, experts.intermediate_dim, experts.num_experts, self.top_k,
                         device="meta")
        dense.router, dense.experts = copy.deepcopy(self.router), experts
        return dense
