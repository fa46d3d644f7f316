"""What a GPU pays for one step, counted on any machine: kernels launched, bytes written by data movement, GEMM
FLOPs and host synchronizations, read off the ATen ops one step dispatches (a ``TorchDispatchMode``).

A CPU's emulated link charges a schedule for its collectives only; a GPU also charges for every kernel launched
(a few microseconds of host time each), every byte a copy, a concatenation or a cast writes (at its memory
bandwidth), and every time the host waits for the device. None of these depends on the device, so they are
counted here on whatever runs the step (``tplayers bench`` counts each mode's steady-state step this way; under
``--simulate``, one rank of any TP size on the fake process group).

- **kernels**: ops that launch work (every op but the views, the metadata ops and the allocations of
  :data:`FREE`; a collective is counted apart, in ``collectives``);
- **moved_bytes**: bytes written by the data-movement ops of :data:`MOVES` (``copy_``, ``cat``, ``clone``, casts,
  scatters, fills), by op;
- **gemm_flops**: 2 * m * n * k of every matmul (``mm``, ``addmm``, ``bmm``, ``baddbmm``; attention kernels
  apart, in ``attention_flops``, the four matmuls of the forward and backward of scaled dot-product attention);
- **host_syncs**: ops whose result the host reads from the device (``.item()``, ``torch.equal``, ``nonzero``,
  ``masked_select``, ``unique``...): on a GPU each one stalls the host until the device catches up. Stream and
  event synchronizes are not ATen ops and are not seen here (``torch.cuda.set_sync_debug_mode`` sees them).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StepCounts", "count_step", "FREE", "MOVES", "HOST_SYNCS", "GEMM_OPS", "ATTENTION_MARK", "gemm_op_flops",
           "attention_op_flops", "tensor_bytes"]

#: Ops that launch no kernel: views, metadata, allocations (an empty tensor is a pointer from the caching allocator).
FREE = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "as_strided",
    "detach", "alias", "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind",
    "narrow", "movedim", "view_as", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
    "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "set_", "resize_", "_has_compatible_shallow_copy_type", "record_stream", "wait_tensor",
})
#: Ops whose writes are data movement (no arithmetic): their output bytes are counted as moved.
MOVES = frozenset({
    "copy_", "copy", "cat", "clone", "_to_copy", "contiguous", "index_put_", "index_put", "scatter", "scatter_",
    "slice_scatter", "select_scatter", "stack", "zero_", "fill_", "zeros_like", "new_zeros", "zeros", "ones",
    "full", "new_full", "index_select", "gather", "index_copy_", "masked_scatter", "constant_pad_nd",
})
#: Ops the host must wait on the device for (their result is read on the host).
HOST_SYNCS = frozenset({
    "_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique", "_unique", "_unique2",
    "unique_consecutive", "unique_dim", "allclose", "repeat_interleave", "bincount", "histc",
})
GEMM_OPS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "matmul", "linear", "_scaled_mm"})
ATTENTION_MARK = "scaled_dot_product"  # in the name of every attention op


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (a tensor, or a list / tuple of them, nested); 0 for anything else."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    return 0


def gemm_op_flops(name: str, args: tuple) -> int:
    """2 m n k (times the batch) of a matmul op from its operand shapes."""
    a, b = (args[1], args[2]) if name.startswith(("addmm", "baddbmm")) else (args[0], args[1])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return 0
    k = a.shape[-1]
    return 2 * math.prod(a.shape[:-1]) * b.shape[-1] * k


def attention_op_flops(name: str, args: tuple) -> int:
    """QK^T and PV of scaled dot-product attention: 4 b h s_q s_k d forward, twice that backward."""
    q, k = args[0], args[1]
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 3:
        return 0
    flops = 4 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
    return 2 * flops if name.endswith("backward") else flops


class StepCounts(TorchDispatchMode):
    """The counts of the ops dispatched while active (see the module docstring). ``as_dict()`` for a report."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.ops: Counter = Counter()
        self.moved: Counter = Counter()
        self.gemm_flops = 0
        self.attention_flops = 0
        self.host_syncs: Counter = Counter()
        self.collectives: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Optional[Tuple[str, int, Optional[str]]]:
        """Count one dispatched op. A kernel: ``(its name, its FLOPs, "gemm" | "attention" | None)``; a collective,
        a view or an allocation: None."""
        name = func.overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional"):
            if name != "wait_tensor":
                self.collectives[name] += 1
            return None
        if name in HOST_SYNCS:
            self.host_syncs[name] += 1
        if name in FREE:
            return None
        self.kernels += 1
        self.ops[name] += 1
        if name in MOVES:
            self.moved[name] += tensor_bytes(out)
        flops, rate = 0, None
        if name in GEMM_OPS:
            flops, rate = gemm_op_flops(name, args), "gemm"
            self.gemm_flops += flops
        elif ATTENTION_MARK in name:
            flops, rate = attention_op_flops(name, args), "attention"
            self.attention_flops += flops
        return name, flops, rate

    def as_dict(self) -> Dict[str, Any]:
        return {"kernels": self.kernels, "moved_bytes": sum(self.moved.values()), "moved_bytes_by_op": dict(self.moved),
                "gemm_flops": self.gemm_flops, "attention_flops": self.attention_flops,
                "host_syncs": sum(self.host_syncs.values()), "host_syncs_by_op": dict(self.host_syncs),
                "collectives": dict(self.collectives), "top_ops": dict(self.ops.most_common(12))}


def count_step(step: Callable[[], None]) -> Dict[str, Any]:
    """One run of ``step`` (call it after its warm-up: a steady-state step) counted; :meth:`StepCounts.as_dict`."""
    with StepCounts() as counts:
        step()
    return counts.as_dict()
