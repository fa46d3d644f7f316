"""Where weight gradients go: later (a WeightGradStore), or into float32 ``main_grad`` buffers.

Later: the W pass of a split backward (ZeroBubble, TransformerEngine's ``delay_wgrad_compute``).

A layer built with ``delay_wgrad=True`` computes only its input gradient in ``loss.backward()`` (the
chain the previous pipeline stage waits for) and records its weight-gradient GEMMs here;
:meth:`WeightGradStore.flush` (``tplayers.backward_dw(model)``) runs them later and accumulates the
results into ``.grad`` exactly as the normal backward would (through the same autograd path from the
tensor the layer consumed to its parameter: autocast's cast, the sum over replicated KV heads).
Gradients are identical to the normal path: the same GEMMs on the same tensors, at another time.

Until it is flushed, a store holds each recorded step's output gradient and input (activation
memory), and the parameters' ``.grad`` lacks those contributions: flush before ``optimizer.step()``,
on every rank, in the same order (under sequence parallelism a flush all-gathers the saved input).

Into buffers (Megatron's ``gradient_accumulation_fusion``): the weight-gradient GEMM adds its
result into a float32 buffer (``param.main_grad``) with one ``addmm``, so bfloat16 training with
gradient accumulation sums the microbatches in float32 without a separate cast-and-add per step.
On CUDA the GEMM takes the bfloat16 inputs and accumulates in float32 (``torch.addmm(...,
out_dtype=float32)``); elsewhere the inputs are upcast first (same sum, slower).
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, NamedTuple, Optional, Sequence, Tuple, Union

import torch

__all__ = ["WeightGradStore", "ReplicatedRows", "accumulate_matmul", "check_main_grads"]


class ReplicatedRows(NamedTuple):
    """A ``main_grad`` buffer some of whose dim-0 rows are replicated over ranks (KV heads shared by
    several ranks): each ``(start, stop, num_shards)`` of ``runs`` is held by ``p // num_shards``
    consecutive ranks. Each backward's contribution to those rows is summed over the replica ranks
    before it is added (as the ``.grad`` path's ``sum_over_replicas``
    does: one all-reduce per run for the weight and one for the bias), so the buffer always holds
    complete gradients and a replica's rows agree on every rank."""

    buffer: torch.Tensor
    runs: Tuple[Tuple[int, int, int], ...]


Compute = Callable[[], Sequence[Optional[torch.Tensor]]]
MainBuffer = Union[torch.Tensor, ReplicatedRows]
MainGrads = Optional[Sequence[Optional[MainBuffer]]]  # (weight buffer, bias buffer) per linear
_OUT_DTYPE_GEMM = [True]  # torch.addmm(out_dtype=) works here (CUDA); switched off at the first refusal


def accumulate_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out``'s precision (``out`` float32, ``a``/``b`` maybe bfloat16)."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        out.addmm_(a, b)
        return
    if out.is_cuda and _OUT_DTYPE_GEMM[0]:
        try:
            out.add_(torch.mm(a, b, out_dtype=out.dtype))  # bf16 inputs, float32 accumulation in the GEMM
            return
        except (RuntimeError, TypeError):  # an older torch or a GPU without the kernel: upcast instead
            _OUT_DTYPE_GEMM[0] = False
    out.addmm_(a.to(out.dtype), b.to(out.dtype))


def check_main_grads(main: MainGrads, weight: torch.Tensor, bias: Optional[torch.Tensor], op: str,
                     group_size: int) -> MainGrads:
    """``main`` as a (weight buffer, bias buffer) pair, or a ValueError naming what does not fit
    (raised on every rank alike, before any collective: a bad replica layout would hang one)."""
    if main is None:
        return None
    if len(main) != 2:
        raise ValueError(f"{op}: main_grads must be (weight_buffer, bias_buffer), got {len(main)} entries")
    for entry, param, name in ((main[0], weight, "weight"), (main[1], bias, "bias")):
        if entry is None:
            continue
        if param is None:
            raise ValueError(f"{op}: a main_grad buffer for the {name} was given but there is no {name}")
        buf = entry.buffer if isinstance(entry, ReplicatedRows) else entry
        if tuple(buf.shape) != tuple(param.shape) or buf.device != param.device or not buf.is_floating_point():
            raise ValueError(f"{op}: the {name}'s main_grad buffer is {tuple(buf.shape)} {buf.dtype} on {buf.device}, "
                             f"the {name} is {tuple(param.shape)} on {param.device}")
        if isinstance(entry, ReplicatedRows):
            done = 0
            for start, stop, num_shards in entry.runs:
                if not done <= start < stop <= buf.shape[0] or num_shards < 1:
                    raise ValueError(f"{op}: the {name}'s replicated rows {entry.runs} must be ordered, non-empty "
                                     f"(start, stop, num_shards) runs within its {buf.shape[0]} rows")
                if group_size % num_shards:
                    raise ValueError(f"{op}: the {name}'s replicated rows {entry.runs}: num_shards={num_shards} does "
                                     f"not divide the TP degree {group_size}")
                done = stop
    return tuple(main)


class WeightGradStore:
    """A FIFO of recorded weight-gradient work: ``put`` during backward, ``flush`` later."""

    def __init__(self) -> None:
        self._work: Deque[Tuple[Tuple[Optional[torch.Tensor], ...], Compute]] = deque()

    def put(self, targets: Sequence[Optional[torch.Tensor]], compute: Compute) -> None:
        """Record ``compute`` (returns one gradient per target, or None) for the tensors ``targets``:
        the weight and bias exactly as the layer's autograd Function received them."""
        self._work.append((tuple(targets), compute))

    def __len__(self) -> int:
        return len(self._work)

    def flush(self) -> int:
        """Run every recorded computation in recording order and accumulate each gradient into its
        parameter through autograd; returns how many ran."""
        count = 0
        while self._work:
            targets, compute = self._work.popleft()
            with torch.no_grad():
                grads = compute()
            pairs = [(t, g.to(t.dtype)) for t, g in zip(targets, grads)
                     if t is not None and g is not None and t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            count += 1
        return count

    def clear(self) -> None:
        """Drop the recorded work without running it (e.g. after a skipped step)."""
        self._work.clear()
