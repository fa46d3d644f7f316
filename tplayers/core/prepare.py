"""What a fused op does to its inputs before its autograd Function, locally (no communication): the
shape / dtype / device checks, autocast's cast (custom Functions do not get it), the CUDA launch-order
warning, and the chunk count of a chunked schedule. (Input values every rank holds whole, such as token
ids, are checked in :mod:`.validate`.)"""
from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .collectives import SEQ_DIM
from .groups import TPGroup

__all__ = ["refuse_replicating_wrapper", "check_linear_inputs", "autocast_inputs", "autocast_dtype", "autocast_enabled", "warn_cuda_connections_once", "require_chunks"]


def check_linear_inputs(op: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        expected_in: int, g: TPGroup, sequence_parallel: bool, collective_matmul: bool = False,
                        seq_divisible: bool = False) -> None:
    """A ValueError / TypeError naming ``op`` unless ``x (..., expected_in)`` fits ``weight`` and ``bias``
    (``seq_divisible``: the sequence dim must split over the group, as a reduce-scatter needs)."""
    refuse_replicating_wrapper(op, g)
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


_WRAPPERS_SEEN: Dict[Tuple[int, int], Tuple[Any, Any]] = {}  # (DDP, TP process group) pairs found fine


def refuse_replicating_wrapper(op: str, g: TPGroup) -> None:
    """A RuntimeError naming the fix when this forward runs inside a ``DistributedDataParallel`` whose process
    group holds two or more ranks of ``g``: DDP's constructor broadcast one rank's parameters to the others,
    so TP peers now hold another rank's shards, and its gradient all-reduce would average different shards.
    Raised on every rank (each runs the same forward), before any backward or step. Local: no collective."""
    if g.size == 1 or torch.compiler.is_compiling():  # (DDP's forward, which sets it, runs outside the graph)
        return
    ddp_module = sys.modules.get("torch.nn.parallel.distributed")
    active = None if ddp_module is None else ddp_module.DistributedDataParallel._active_ddp_module
    if active is None:
        return
    key = (id(active), id(g.process_group))
    seen = _WRAPPERS_SEEN.get(key)
    if seen is not None and seen[0]() is active and seen[1] is g.process_group:
        return
    wrapper = dist.get_process_group_ranks(active.process_group)
    shared = g.peers_among(wrapper)
    if len(shared) < 2:
        _WRAPPERS_SEEN[key] = (weakref.ref(active), g.process_group)
        return
    raise RuntimeError(
        f"{op}: the model runs inside DistributedDataParallel over ranks {sorted(wrapper)}, which include TP peers "
        f"{shared} (this layer's TP group: ranks {g.global_ranks()}). DDP's constructor copied rank {min(wrapper)}'s parameters to "
        "every rank of its group, so these TP ranks now hold another rank's shards, and its gradient all-reduce would "
        "average different shards. Wrap DDP over the data-parallel ranks only: mesh = tplayers.make_2d_mesh(dp=..., "
        "tp=...); parallelize(model, plan, group=mesh.mesh); DDP(model, process_group=mesh.dp_group) (docs/models.md, "
        "'2-D parallelism'). transformers.Trainer and accelerate wrap DDP over the whole world: they cannot train a "
        "tplayers model (docs/models.md, 'Checkpoints and resuming at scale')")


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
    dtype = autocast_dtype(x)
    if dtype is None:
        return x, weight, bias
    cast = lambda t: None if t is None else (t if t.dtype == dtype else t.to(dtype))  # noqa: E731
    return cast(x), cast(weight), cast(bias)


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast computes a linear layer on ``x`` in, or None when autocast is off."""
    return torch.get_autocast_dtype(x.device.type) if autocast_enabled(x) else None


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
