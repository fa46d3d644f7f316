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

from .collectives import SEQ_DIM, ring_exchange
from .groups import TPGroup

__all__ = ["ring_gather_linear", "ring_linear_scatter"]


def ring_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], g: TPGroup,
                       gathered: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(all_gather(x, seq), weight, bias)``: x ``(..., s/p, in)`` -> ``(..., s, out_local)``;
    the chunk of rank r - k is multiplied while the chunk of rank r - k - 1 arrives. ``gathered``
    (``(..., s, in)``), when given, receives ``all_gather(x, seq)`` too (the row layer's backward
    needs the whole output gradient for its weight gradient)."""
    chunk = x.contiguous()
    sl = chunk.shape[SEQ_DIM]
    out = torch.empty(chunk.shape[:-2] + (sl * g.size, weight.shape[0]), dtype=chunk.dtype, device=chunk.device)
    for k in range(g.size):
        arriving = None
        if k < g.size - 1:
            arriving = ring_exchange(chunk, torch.empty_like(chunk), g)
        src = (g.rank - k) % g.size  # whose sequence chunk this is
        out.narrow(SEQ_DIM, src * sl, sl).copy_(F.linear(chunk, weight, bias))
        if gathered is not None:
            gathered.narrow(SEQ_DIM, src * sl, sl).copy_(chunk)
        if arriving is not None:
            chunk = arriving.wait()
    return out


def ring_linear_scatter(x: torch.Tensor, weight: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """``reduce_scatter(F.linear(x, weight), seq)``: x ``(..., s, in_local)`` -> this rank's ``(..., s/p, out)``
    block of the sum over ranks; each step adds this rank's partial for the block passing by, the next
    block's GEMM running while the running sum travels."""
    if x.shape[SEQ_DIM] % g.size:
        raise ValueError(f"collective matmul: sequence length {x.shape[SEQ_DIM]} is not divisible by the TP "
                         f"degree {g.size}")
    sl = x.shape[SEQ_DIM] // g.size

    def partial(block: int) -> torch.Tensor:
        return F.linear(x.narrow(SEQ_DIM, block * sl, sl), weight).contiguous()  # (..., s/p, out)

    running = partial((g.rank - 1) % g.size)
    for k in range(1, g.size):  # after step k the running sum of block (r - k - 1) holds k + 1 ranks
        arriving = ring_exchange(running, torch.empty_like(running), g)
        mine = partial((g.rank - k - 1) % g.size)  # under the transfer
        running = mine.add_(arriving.wait())
    return running  # block r, summed over every rank
