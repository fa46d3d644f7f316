"""Collective matmul: the sequence-parallel all-gather and reduce-scatter cut into ring steps under GEMMs.

Under sequence parallelism the column layer's input all-gather and the row layer's output
reduce-scatter can be cut into p ring steps of point-to-point sends, each step's GEMM running while
the next chunk travels (Wang et al., "Overlap communication with dependent computation via
decomposition", ASPLOS 2023; PyTorch's async TP does it with symmetric memory on CUDA). Here with
plain batch_isend_irecv, any backend. Same numbers as the collective form up to summation order.
In backward the row layer's all-gather of its output gradient feeds its input-gradient GEMM the same
way (the same ring); the column layer's backward collectives already run under its own GEMMs.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .collectives import from_rank_major, ring_exchange
from .groups import TPGroup

__all__ = ["ring_gather_linear", "ring_linear_scatter"]


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """``out = F.linear(x, weight, bias)``, written into ``out`` (contiguous): one GEMM, no copy."""
    x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    if bias is None:
        torch.mm(x2, weight.t(), out=out2)
    else:
        torch.addmm(bias, x2, weight.t(), out=out2)


def ring_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], g: TPGroup,
                       gathered: Optional[torch.Tensor] = None, rank_major: bool = False) -> torch.Tensor:
    """``F.linear(all_gather(x, seq), weight, bias)``: x ``(..., s/p, in)`` -> ``(..., s, out_local)``;
    the chunk of rank r - k is multiplied while the chunk of rank r - k - 1 arrives. Each step's GEMM writes
    its own block of a rank-major output (``(p, ..., s/p, out_local)``, see ``collectives.to_rank_major``),
    reordered once at the end (the narrow side; ``rank_major``: left so, for a caller whose next GEMM takes the
    tokens in that order, a region's token-wise core). ``gathered`` (``(p, ..., s/p, in)``), when given, receives
    the rank-major gather of x too, each chunk landing there directly (the row layer's backward needs the
    whole output gradient for its weight gradient)."""
    chunk = x.contiguous()
    out = chunk.new_empty((g.size,) + chunk.shape[:-1] + (weight.shape[0],))  # (p, ..., s/p, out_local)
    if gathered is not None:
        gathered[g.rank].copy_(chunk)
    for k in range(g.size):
        src = (g.rank - k) % g.size  # whose sequence chunk this is
        arriving = None
        if k < g.size - 1:
            landing = gathered[(src - 1) % g.size] if gathered is not None else torch.empty_like(chunk)
            arriving = ring_exchange(chunk, landing, g)
        _linear_into(out[src], chunk, weight, bias)
        if arriving is not None:
            chunk = arriving.wait()
    return out if rank_major else from_rank_major(out)


def ring_linear_scatter(x: torch.Tensor, weight: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """``reduce_scatter(F.linear(x, weight), seq)``: x rank-major ``(p, ..., s/p, in_local)`` -> this rank's
    ``(..., s/p, out)`` block of the sum over ranks; each step adds this rank's partial for the block passing by,
    the next block's GEMM running while the running sum travels."""
    def partial(block: int) -> torch.Tensor:
        return F.linear(x[block], weight)  # (..., s/p, out), contiguous

    running = partial((g.rank - 1) % g.size)
    for k in range(1, g.size):  # after step k the running sum of block (r - k - 1) holds k + 1 ranks
        arriving = ring_exchange(running, torch.empty_like(running), g)
        mine = partial((g.rank - k - 1) % g.size)  # under the transfer
        running = mine.add_(arriving.wait())
    return running  # block r, summed over every rank
