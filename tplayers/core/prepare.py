"""What a fused op does to its inputs before its autograd Function, locally (no communication): the
shape / dtype / device checks, autocast's cast (custom Functions do not get it), the CUDA launch-order
warning, and the chunk count of a chunked schedule. (Input values every rank holds whole, such as token
ids, are checked in :mod:`.validate`.)"""
from __future__ import annotations

import os
import warnings
from typing import Optional, Tuple

import torch

from .collectives import SEQ_DIM
from .groups import TPGroup

__all__ = ["check_linear_inputs", "autocast_inputs", "autocast_enabled", "warn_cuda_connections_once", "require_chunks"]


def check_linear_inputs(op: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        expected_in: int, g: TPGroup, sequence_parallel: bool, collective_matmul: bool = False,
                        seq_divisible: bool = False) -> None:
    """A ValueError / TypeError naming ``op`` unless ``x (..., expected_in)`` fits ``weight`` and ``bias``
    (``seq_divisible``: the sequence dim must split over the group, as a reduce-scatter needs)."""
    if x.dim() < 1:
        raise ValueError(f"{op}: input is a 0-dim tensor, expected (..., {expected_in})")
    if x.shape[-1] != expected_in:
        raise ValueError(f"{op}: input's last dim is {x.shape[-1]} (shape {tuple(x.shape)}), expected {expected_in}")
    if x.device != weight.device:
        raise ValueError(f"{op}: input is on {x.device} but the weight is on {weight.device}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{op}: input dtype {x.dtype} does not match the weight dtype {weight.dtype} "
            "(cast the input or the module, or run under torch.autocast)"
        )
    if bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"{op}: bias dtype {bias.dtype} does not match the weight dtype {weight.dtype}")
    if sequence_parallel and x.dim() < 2:
        raise ValueError(f"{op}: sequence parallelism needs a [..., seq, hidden] input, got {tuple(x.shape)}")
    if collective_matmul and not sequence_parallel:
        raise ValueError(f"{op}: collective_matmul decomposes the sequence-parallel all-gather / reduce-scatter; "
                         "it needs sequence_parallel=True")
    if seq_divisible and sequence_parallel and g.size > 1 and x.shape[SEQ_DIM] % g.size != 0:
        raise ValueError(f"{op}: sequence length {x.shape[SEQ_DIM]} is not divisible by the TP degree {g.size} "
                         "(sequence parallelism splits it across ranks)")


def require_chunks(chunks: int, where: str) -> int:
    """``chunks``, or a ValueError naming ``where`` unless it is an integer >= 1."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{where}: chunks must be an integer >= 1, got {chunks!r}")
    return chunks


# One cheap C call answering "is autocast on for any device?" (torch >= 2.4); it spares the
# per-call device-type lookup on the common path.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)


def autocast_enabled(x: torch.Tensor) -> bool:
    """Whether autocast is on for ``x``'s device type."""
    return bool(_any_autocast()) and torch.is_autocast_enabled(x.device.type)


def autocast_inputs(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
                    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Autocast's cast, applied before a custom Function (which autocast does not see); unchanged
    when autocast is off."""
    if not autocast_enabled(x):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(x.device.type)
    cast = lambda t: None if t is None else (t if t.dtype == dtype else t.to(dtype))  # noqa: E731
    return cast(x), cast(weight), cast(bias)


_warned_cuda_connections = [False]


def warn_cuda_connections_once(x: torch.Tensor, g: TPGroup, overlap_comm: bool) -> None:
    """Warn once when overlap on CUDA may be lost to launch order (see `tplayers.core.functional`)."""
    if _warned_cuda_connections[0] or not overlap_comm or g.size == 1 or not x.is_cuda:
        return
    _warned_cuda_connections[0] = True
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        warnings.warn(
            "tplayers: CUDA_DEVICE_MAX_CONNECTIONS is not 1, so the GPU may schedule the "
            "weight-gradient GEMM ahead of the async input-gradient collective and serialize "
            "them. Results are unaffected; for full overlap export CUDA_DEVICE_MAX_CONNECTIONS=1 "
            "before CUDA initializes.",
            stacklevel=3,
        )
