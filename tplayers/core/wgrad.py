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

from .collectives import Pending
from .seq_order import gather_sequence
from .blocking import sum_over_replica_ranks
from .groups import TPGroup

__all__ = ["WeightGradStore", "WgradSink", "ReplicatedRows", "accumulate_matmul", "check_main_grads",
           "linear_wgrads", "chunked_wgrads", "region_wgrads"]


class ReplicatedRows(NamedTuple):
    """A ``main_grad`` buffer some of whose dim-0 rows are replicated over ranks (KV heads shared by
    several ranks): the rows ``[start, stop)`` of each ``(start, stop, holders)`` of ``runs`` are held
    by runs of ``holders[j]`` consecutive ranks (``(2, 2)`` at TP 4; ``(2, 1)`` at TP 3). Each backward's contribution to those rows is summed over the replica ranks
    before it is added (as the ``.grad`` path's ``sum_over_replicas``
    does: one all-reduce per run for the weight and one for the bias), so the buffer always holds
    complete gradients and a replica's rows agree on every rank."""

    buffer: torch.Tensor
    runs: Tuple[Tuple[int, int, Tuple[int, ...]], ...]


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
            for start, stop, holders in entry.runs:
                if not done <= start < stop <= buf.shape[0]:
                    raise ValueError(f"{op}: the {name}'s replicated rows {entry.runs} must be ordered, non-empty "
                                     f"(start, stop, holders) runs within its {buf.shape[0]} rows")
                if not holders or min(holders) < 1 or sum(holders) != group_size:
                    raise ValueError(f"{op}: the {name}'s replicated rows {entry.runs}: holders={tuple(holders)} do "
                                     f"not cover the TP group of {group_size} ranks")
                done = stop
    return tuple(main)


class WeightGradStore:
    """A FIFO of recorded weight-gradient work: ``put`` during backward, ``flush`` later.
    ``WeightGradStore.pending_total``: the work recorded in every store of the process and not yet run
    (one integer read tells an optimizer step whether any is waiting)."""

    pending_total = 0

    def __init__(self) -> None:
        self._work: Deque[Tuple[Tuple[Optional[torch.Tensor], ...], Compute]] = deque()

    def put(self, targets: Sequence[Optional[torch.Tensor]], compute: Compute) -> None:
        """Record ``compute`` (returns one gradient per target, or None) for the tensors ``targets``:
        the weight and bias exactly as the layer's autograd Function received them."""
        self._work.append((tuple(targets), compute))
        WeightGradStore.pending_total += 1

    def __len__(self) -> int:
        return len(self._work)

    def flush(self) -> int:
        """Run every recorded computation in recording order and accumulate each gradient into its
        parameter through autograd; returns how many ran."""
        count = 0
        while self._work:
            targets, compute = self._work.popleft()
            WeightGradStore.pending_total -= 1
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
        WeightGradStore.pending_total -= len(self._work)
        self._work.clear()


# ---------------------------------------------------------------------------- routing one layer's gradients


class WgradSink:
    """Where a fused op's weight and bias gradients go, fixed when its forward runs: returned now
    (autograd writes ``.grad``), added into ``main_grad`` buffers (``main``), or recorded in a
    `WeightGradStore` and computed at its flush (``store``: delay_wgrad). ``targets``: the weights
    and biases exactly as the autograd Function received them (the store's flush sends each gradient
    through autograd from there). ``gather_input``: the layer's input is this rank's sequence chunk
    (sequence parallelism): a recorded computation gathers it at flush. (The column / row linears make one
    only for buffers or a store: they return their gradients to autograd themselves.)"""

    __slots__ = ("g", "store", "main", "targets", "gather_input", "rank_major")

    def __init__(self, g: TPGroup, store: Optional[WeightGradStore] = None, main: MainGrads = None,
                 targets: Sequence[Optional[torch.Tensor]] = (), gather_input: bool = False,
                 rank_major: bool = False) -> None:
        self.g, self.store, self.main, self.gather_input = g, store, main, gather_input
        self.rank_major = rank_major  # the gathered input's token order (seq_order: the layer's backward chooses)
        self.targets = tuple(targets) if store is not None else ()  # held only until recorded

    @property
    def now(self) -> bool:
        return self.store is None

    def input(self, x: torch.Tensor, need_w: bool, *, async_op: bool) -> Union[torch.Tensor, Pending]:
        """What the weight gradient will multiply: ``x``, or under sequence parallelism (computed now)
        the gather of every rank's chunk, launched here so that it travels under the caller's next GEMM."""
        if self.gather_input and need_w and self.now:
            return gather_sequence(x, self.g, self.rank_major, async_op=async_op)
        return x

    def linear(self, grad_out: torch.Tensor, x: Union[torch.Tensor, Pending], need_w: bool,
               need_b: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(grad_W, grad_b)`` of ``y = x W^T + b`` (from :meth:`input`'s ``x``); None where not needed,
        added into a main_grad buffer, or recorded for later."""
        return self.route((need_w, need_b), lambda: linear_wgrads(grad_out, self.whole(x), need_w, need_b,
                                                                   self.main, self.g))

    def whole(self, x: Union[torch.Tensor, Pending]) -> torch.Tensor:
        """:meth:`input`'s result as the whole input: the gather waited for; or, computed at a flush,
        the shard gathered then."""
        if isinstance(x, Pending):
            return x.wait()
        return gather_sequence(x, self.g, self.rank_major).wait() if self.gather_input and not self.now else x

    def route(self, needs: Sequence[bool], compute: Callable[[], Sequence[Optional[torch.Tensor]]]
              ) -> Tuple[Optional[torch.Tensor], ...]:
        """``compute()`` now; or recorded in the store for the targets that need a gradient (Nones now)."""
        if self.store is None:
            return tuple(compute())
        wanted = tuple(t if need else None for t, need in zip(self.targets, needs))
        if any(t is not None for t in wanted):
            self.store.put(wanted, compute)
        self.targets = ()
        return (None,) * len(needs)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def linear_wgrads(grad_out: torch.Tensor, x: torch.Tensor, need_w: bool, need_b: bool, main: MainGrads,
                  g: TPGroup) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(grad_out^T x, grad_out summed)`` over all leading dims, each only when needed; with
    ``main`` = (weight buffer, bias buffer), each is accumulated into its buffer instead (None returned)."""
    grad_flat = _flat(grad_out)
    main_w, main_b = main if main is not None else (None, None)
    grad_w = grad_b = None
    if need_w:
        if main_w is not None:
            x_flat = _flat(x)  # (tokens, in), once for every row range
            _accumulate(main_w, grad_flat.t(), g, lambda out, a: accumulate_matmul(out, a, x_flat))
        else:
            grad_w = grad_flat.t() @ _flat(x)
    if need_b:
        if main_b is not None:
            _accumulate(main_b, grad_flat.t(), g, lambda out, a: out.add_(a.sum(1, dtype=out.dtype)))
        else:
            grad_b = grad_flat.sum(0)
    return grad_w, grad_b


def chunked_wgrads(grads: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], need_w: bool, need_b: bool,
                   main: MainGrads, g: TPGroup) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`linear_wgrads` over batch chunks, ``grads[i]`` paired with ``xs[i]``: one GEMM per chunk accumulated into
    the first's result, no concatenation (a chunk's GEMM costs what its share of one GEMM does; a concatenation
    copies both operands). ``main`` buffers take the chunks joined (a buffer of replicated rows sums over its
    ranks once per call)."""
    if len(grads) == 1 or main is not None:
        join = lambda ts: ts[0] if len(ts) == 1 else torch.cat(list(ts), 0)  # noqa: E731
        return linear_wgrads(join(grads), join(xs), need_w, need_b, main, g)
    grad_w = grad_b = None
    for grad, x in zip(grads, xs):
        grad_flat = _flat(grad)  # (tokens of this chunk, out)
        if need_w:
            grad_w = grad_flat.t() @ _flat(x) if grad_w is None else grad_w.addmm_(grad_flat.t(), _flat(x))
        if need_b:
            grad_b = grad_flat.sum(0) if grad_b is None else grad_b.add_(grad_flat.sum(0))
    return grad_w, grad_b


def region_wgrads(row: Tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
                  column: Callable[[], Tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]], needs: Sequence[bool],
                  main: MainGrads, g: TPGroup) -> Tuple[Optional[torch.Tensor], ...]:
    """A column -> core -> row region's weight gradients ``(w1, b1, w2, b2)``: the row layer's first (``row``: its
    output gradients and inputs, chunk by chunk), then the column layer's; ``column()`` (its input gradients and
    whole inputs, chunk by chunk) is asked for only between the two, so a gather of the input still in flight
    travels under the row layer's GEMMs (``needs`` in the order w1, b1, w2, b2; ``main``: the four main_grad
    buffers, or None). Chunks: :func:`chunked_wgrads`."""
    need_w1, need_b1, need_w2, need_b2 = needs
    grad_w2, grad_b2 = chunked_wgrads(*row, need_w2, need_b2, None if main is None else main[2:], g)
    grad_w1, grad_b1 = chunked_wgrads(*column(), need_w1, need_b1, None if main is None else main[:2], g)
    return grad_w1, grad_b1, grad_w2, grad_b2


def _accumulate(main: MainBuffer, grad_t: torch.Tensor, g: TPGroup,
                add: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """``add(out, rows of grad_t)`` into ``main`` row by row range (``grad_t``: ``(out, tokens)``, its
    row i the output gradient of the parameter's row i). A `ReplicatedRows` buffer's replicated runs
    are first added into a zero buffer and summed over their replica ranks (as the ``.grad`` path
    sums them), so the buffer gains complete gradients only."""
    if not isinstance(main, ReplicatedRows):
        add(main, grad_t)
        return
    buf, done = main.buffer, 0
    for start, stop, holders in main.runs:
        if done < start:
            add(buf[done:start], grad_t[done:start])
        part = buf.new_zeros(buf[start:stop].shape)
        add(part, grad_t[start:stop])
        buf[start:stop].add_(sum_over_replica_ranks(part, g, holders) if max(holders) > 1 else part)
        done = stop
    if done < buf.shape[0]:
        add(buf[done:], grad_t[done:])
