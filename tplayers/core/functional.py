"""The fused tensor-parallel linear ops: the one place that orders communication against compute.

``column_parallel_linear``: ``x`` replicated (or sequence-sharded), ``weight`` holds this rank's
rows (output features). Backward computes the input gradient first, launches its all-reduce
(reduce-scatter under sequence parallelism) asynchronously, computes the weight and bias
gradients while it is in flight, and only then waits::

    grad_x = grad_out @ W            # (..., in)
    pending = all_reduce(grad_x)     # async
    grad_W = grad_out^T @ x          # overlaps the all-reduce
    grad_b = grad_out.sum(0)
    grad_x = pending.wait()

Under sequence parallelism the forward all-gathers the input shard along the sequence dim and
saves only the shard; backward re-gathers it asynchronously under the input-gradient matmul,
then reduce-scatters the input gradient under the weight-gradient matmul.

``row_parallel_linear``: ``x`` sharded along its last dim, ``weight`` holds this rank's columns;
the partial products are all-reduced (reduce-scattered along the sequence dim under sequence
parallelism) and the full bias is added once, after the reduction.

``overlap_comm=False`` runs the same ops with blocking collectives, in the same order, so the
results are bit-identical; it exists to measure what the overlap buys.

CUDA launch order: an async NCCL collective runs on its own stream. When the GPU has several
hardware work queues (``CUDA_DEVICE_MAX_CONNECTIONS`` > 1, the default) a weight-gradient GEMM
launched after the collective can be scheduled ahead of it and take every SM, so the two run
one after the other instead of overlapping. Results are correct either way; for full overlap
set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` before CUDA is initialized (one queue: kernels start in
launch order). tplayers never sets it behind your back; it warns once when it is not set.
"""
from __future__ import annotations

import os
import warnings
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from .collectives import Pending, _all_gather, _all_reduce, _reduce_scatter, _ring_exchange, _sum_over_replica_ranks
from .comm import copy_to_tp, gather_from_sequence, reduce_from_tp, reduce_scatter_to_sequence, scatter_to_tp
from .groups import GroupLike, TPGroup, resolve_group
from .wgrad import (MainBuffer, MainGrads, ReplicatedRows, WeightGradStore, accumulate_matmul,
                    check_main_grads as _check_main_grads)

__all__ = ["column_parallel_linear", "row_parallel_linear", "parallel_mlp", "split_backward_region", "SEQ_DIM"]

SEQ_DIM = -2  # batch-first activations: the sequence dim is the one before hidden

_warned_cuda_connections = False


def _warn_cuda_connections_once(x: torch.Tensor, g: TPGroup, overlap: bool) -> None:
    global _warned_cuda_connections
    if _warned_cuda_connections or not overlap or g.size == 1 or not x.is_cuda:
        return
    _warned_cuda_connections = True
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        warnings.warn(
            "tplayers: CUDA_DEVICE_MAX_CONNECTIONS is not 1, so the GPU may schedule the "
            "weight-gradient GEMM ahead of the async input-gradient collective and serialize "
            "them. Results are unaffected; for full overlap export CUDA_DEVICE_MAX_CONNECTIONS=1 "
            "before CUDA initializes.",
            stacklevel=3,
        )


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    expected_in: int,
    op: str,
    sequence_parallel: bool,
    g: TPGroup,
) -> None:
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
    if sequence_parallel:
        if x.dim() < 2:
            raise ValueError(f"{op}: sequence parallelism needs a [..., seq, hidden] input, got {tuple(x.shape)}")


# One cheap C call answering "is autocast on for any device?" (torch >= 2.4); it spares the
# per-call device-type lookup on the common path.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)


def autocast_enabled(x: torch.Tensor) -> bool:
    """Whether autocast is on for ``x``'s device type."""
    return bool(_any_autocast()) and torch.is_autocast_enabled(x.device.type)


def _autocast(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """Apply autocast's cast before entering the custom Function (which autocast does not see)."""
    if not _any_autocast():
        return x, weight, bias
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    cast = lambda t: None if t is None else (t if t.dtype == dtype else t.to(dtype))  # noqa: E731
    return cast(x), cast(weight), cast(bias)


# ---------------------------------------------------------------------------- collective matmul (SP)
#
# Under sequence parallelism the column layer's input all-gather and the row layer's output
# reduce-scatter can be cut into p ring steps of point-to-point sends, each step's GEMM running while
# the next chunk travels (Wang et al., "Overlap communication with dependent computation via
# decomposition", ASPLOS 2023; PyTorch's async TP does it with symmetric memory on CUDA). Here with
# plain batch_isend_irecv, any backend. Same numbers as the collective form up to summation order.
# In backward the row layer's all-gather of its output gradient feeds its input-gradient GEMM the same
# way (the same ring); the column layer's backward collectives already run under its own GEMMs.


def _ring_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], g: TPGroup,
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
            arriving = _ring_exchange(chunk, torch.empty_like(chunk), g)
        src = (g.rank - k) % g.size  # whose sequence chunk this is
        out.narrow(SEQ_DIM, src * sl, sl).copy_(F.linear(chunk, weight, bias))
        if gathered is not None:
            gathered.narrow(SEQ_DIM, src * sl, sl).copy_(chunk)
        if arriving is not None:
            chunk = arriving.wait()
    return out


def _ring_linear_scatter(x: torch.Tensor, weight: torch.Tensor, g: TPGroup) -> torch.Tensor:
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
        arriving = _ring_exchange(running, torch.empty_like(running), g)
        mine = partial((g.rank - k - 1) % g.size)  # under the transfer
        running = mine.add_(arriving.wait())
    return running  # block r, summed over every rank


def _check_ring(collective_matmul: bool, sequence_parallel: bool, op: str) -> None:
    if collective_matmul and not sequence_parallel:
        raise ValueError(f"{op}: collective_matmul decomposes the sequence-parallel all-gather / reduce-scatter; "
                         "it needs sequence_parallel=True")


def _defer(ctx, store: WeightGradStore, targets, compute) -> None:
    """Record ``compute`` (the weight gradients) in ``store`` for the inputs that need a gradient."""
    wanted = tuple(t if need else None for t, need in zip(targets, ctx.needs_input_grad[1:]))
    if any(t is not None for t in wanted):
        store.put(wanted, compute)


def _linear_wgrads(grad_out: torch.Tensor, x: torch.Tensor, need_w: bool, need_b: bool,
                   main: MainGrads, g: TPGroup):
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
    for start, stop, num_shards in main.runs:
        if done < start:
            add(buf[done:start], grad_t[done:start])
        part = buf.new_zeros(buf[start:stop].shape)
        add(part, grad_t[start:stop])
        buf[start:stop].add_(_sum_over_replica_ranks(part, g, num_shards) if num_shards < g.size else part)
        done = stop
    if done < buf.shape[0]:
        add(buf[done:], grad_t[done:])


class _ColumnParallelLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, g: TPGroup, sequence_parallel: bool, overlap: bool,
                store: Optional[WeightGradStore] = None, main: MainGrads = None, ring: bool = False):
        ctx.save_for_backward(x, weight)  # under sequence parallelism: only this rank's shard
        ctx.g, ctx.sequence_parallel, ctx.overlap = g, sequence_parallel, overlap
        ctx.has_bias = bias is not None
        ctx.store, ctx.targets, ctx.main = store, ((weight, bias) if store is not None else None), main
        if sequence_parallel and ring:  # collective matmul: the gather in p ring steps under the GEMMs
            return _ring_gather_linear(x, weight, bias, g)
        x_full = _all_gather(x, SEQ_DIM, g).wait() if sequence_parallel else x
        return F.linear(x_full, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: the backward must itself be differentiable
            return _column_backward_graph(ctx, grad_out)
        x, weight = ctx.saved_tensors
        g, sp, overlap = ctx.g, ctx.sequence_parallel, ctx.overlap
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        if ctx.store is not None:  # delay_wgrad: the input gradient now, the weight gradients at flush
            main = ctx.main
            _defer(ctx, ctx.store, ctx.targets, lambda: _linear_wgrads(
                grad_out, _all_gather(x, SEQ_DIM, g).wait() if sp else x, need_w, need_b, main, g))
            ctx.targets = None
            grad_x = None
            if need_x:
                grad_x = grad_out @ weight
                grad_x = (_reduce_scatter(grad_x, SEQ_DIM, g) if sp else _all_reduce(grad_x, g)).wait()
            return grad_x, None, None, None, None, None, None, None, None

        gathering = _all_gather(x, SEQ_DIM, g, async_op=overlap) if (sp and need_w) else None
        grad_x = reducing = None
        if need_x:
            grad_x = grad_out @ weight  # (..., in): a fresh buffer we own, safe to reduce in place
        x_full = gathering.wait() if gathering is not None else x
        if need_x:
            if sp:
                reducing = _reduce_scatter(grad_x, SEQ_DIM, g, async_op=overlap)
            else:
                reducing = _all_reduce(grad_x, g, async_op=overlap)

        # (out_shard, in) and (out_shard,), under the collective (into main_grad buffers if given)
        grad_w, grad_b = _linear_wgrads(grad_out, x_full, need_w, need_b, ctx.main, g)
        if reducing is not None:
            grad_x = reducing.wait()
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class _RowParallelLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, g: TPGroup, sequence_parallel: bool, store: Optional[WeightGradStore] = None,
                main: MainGrads = None, ring: bool = False):
        if sequence_parallel and ring:  # collective matmul: the reduce-scatter in p ring steps under the GEMMs
            out = _ring_linear_scatter(x, weight, g)
        else:
            partial = F.linear(x, weight)  # (..., out): this rank's share of the sum, owned
            if sequence_parallel:
                out = _reduce_scatter(partial, SEQ_DIM, g).wait()
            else:
                out = _all_reduce(partial, g).wait()
        if bias is not None:
            out = out.add_(bias)  # the full bias, added once (out is a buffer we own)
        ctx.save_for_backward(x, weight)
        ctx.g, ctx.sequence_parallel, ctx.has_bias, ctx.ring = g, sequence_parallel, bias is not None, ring
        ctx.store, ctx.targets, ctx.main = store, ((weight, bias) if store is not None else None), main
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: the backward must itself be differentiable
            return _row_backward_graph(ctx, grad_out)
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # Under sequence parallelism each rank holds the gradient of its sequence chunk; the
        # matmuls need all of it. Gathered, it also gives every rank the full bias gradient.
        if ctx.sequence_parallel and ctx.ring and need_x:
            # collective matmul: the gather in p ring steps, each chunk's input-gradient GEMM under the
            # next chunk's transfer; the gathered gradient is kept for the weight gradients
            grad_full = grad_out.new_empty(x.shape[:-1] + grad_out.shape[-1:])  # (..., s, out)
            grad_x = _ring_gather_linear(grad_out, weight.t(), None, ctx.g, gathered=grad_full)
        else:
            grad_full = _all_gather(grad_out, SEQ_DIM, ctx.g).wait() if ctx.sequence_parallel else grad_out
            grad_x = grad_full @ weight if need_x else None
        need_b = need_b and ctx.has_bias
        if ctx.store is not None:  # delay_wgrad: the weight gradients at flush
            main, g = ctx.main, ctx.g
            _defer(ctx, ctx.store, ctx.targets, lambda: _linear_wgrads(grad_full, x, need_w, need_b, main, g))
            ctx.targets = None
            return grad_x, None, None, None, None, None, None, None
        grad_w, grad_b = _linear_wgrads(grad_full, x, need_w, need_b, ctx.main, ctx.g)
        return grad_x, grad_w, grad_b, None, None, None, None, None


# Under create_graph=True (a gradient penalty, a Hessian-vector product) the backward is built from
# the differentiable collectives of `comm` instead: the same numbers, without the overlap, and a graph
# that autograd can differentiate again. Plain training never takes these paths.


def _column_backward_graph(ctx, grad_out):
    x, weight = ctx.saved_tensors
    g, sp = ctx.g, ctx.sequence_parallel
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x = grad_w = grad_b = None
    if need_x:  # partial sums of the input gradient, one per rank
        partial = grad_out @ weight
        grad_x = (reduce_scatter_to_sequence(partial, group=g, seq_dim=SEQ_DIM) if sp
                  else reduce_from_tp(partial, group=g))
    if need_w:
        x_full = gather_from_sequence(x, group=g, seq_dim=SEQ_DIM) if sp else x
        grad_w = _flat(grad_out).t() @ _flat(x_full)
    if need_b and ctx.has_bias:
        grad_b = _flat(grad_out).sum(0)
    return grad_x, grad_w, grad_b, None, None, None, None, None, None


def _row_backward_graph(ctx, grad_out):
    x, weight = ctx.saved_tensors
    g, sp = ctx.g, ctx.sequence_parallel
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    # the (replicated or sequence-sharded) output gradient enters this rank's shard of the matmuls
    grad_in = gather_from_sequence(grad_out, group=g, seq_dim=SEQ_DIM) if sp else copy_to_tp(grad_out, group=g)
    grad_x = grad_in @ weight if need_x else None
    grad_w = _flat(grad_in).t() @ _flat(x) if need_w else None
    grad_b = None
    if need_b and ctx.has_bias:  # the bias is replicated: under sequence parallelism sum the chunks' sums
        grad_b = _flat(grad_out).sum(0)
        grad_b = reduce_from_tp(grad_b, group=g) if sp else grad_b
    return grad_x, grad_w, grad_b, None, None, None, None, None


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group: GroupLike,
    sequence_parallel: bool = False,
    overlap_comm: bool = True,
    wgrad_store: Optional[WeightGradStore] = None,
    main_grads: MainGrads = None,
    collective_matmul: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for this rank's output features; output is sharded on the last dim.

    x: ``(..., in)`` replicated, or ``(..., seq/p, in)`` with ``sequence_parallel``.
    weight: ``(out/p, in)``; bias: ``(out/p,)`` or None. Returns ``(..., [seq,] out/p)``.
    ``wgrad_store``: backward computes only the input gradient and records the weight and bias
    gradients there (:class:`~tplayers.core.wgrad.WeightGradStore`, run by its ``flush``).
    ``main_grads``: ``(weight buffer, bias buffer or None)``, e.g. float32 ``main_grad`` buffers:
    the weight-gradient GEMM accumulates into them (``addmm``; on CUDA in float32 from bfloat16
    inputs) and returns no gradient for those parameters (Megatron's gradient_accumulation_fusion).
    A buffer wrapped in `tplayers.core.wgrad.ReplicatedRows` has its replicated rows' contribution
    summed over their replica ranks first (collective: every rank of the group runs the backward).
    """
    g = resolve_group(group)
    _check_inputs(x, weight, bias, weight.shape[1], "column_parallel_linear", sequence_parallel, g)
    _check_ring(collective_matmul, sequence_parallel, "column_parallel_linear")
    plain = wgrad_store is None and main_grads is None
    if g.size == 1 and plain and not _any_autocast():
        return F.linear(x, weight, bias)  # a world of one: exactly nn.Linear, no further Python
    _warn_cuda_connections_once(x, g, overlap_comm)
    x, weight, bias = _autocast(x, weight, bias)
    if g.size == 1 and plain:
        return F.linear(x, weight, bias)
    return _ColumnParallelLinearFn.apply(x, weight, bias, g, sequence_parallel, overlap_comm, wgrad_store,
                                         _check_main_grads(main_grads, weight, bias, "column_parallel_linear", g.size),
                                         collective_matmul)


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    group: GroupLike,
    input_is_parallel: bool = True,
    sequence_parallel: bool = False,
    overlap_comm: bool = True,
    wgrad_store: Optional[WeightGradStore] = None,
    main_grads: MainGrads = None,
    collective_matmul: bool = False,
) -> torch.Tensor:
    """Sum over ranks of ``x_shard @ weight_shard.T``, plus the full ``bias`` once.

    x: ``(..., in/p)`` (``input_is_parallel``) or ``(..., in)`` replicated, which is split here.
    weight: ``(out, in/p)``; bias: ``(out,)`` or None. Returns ``(..., out)`` replicated, or
    ``(..., seq/p, out)`` with ``sequence_parallel``. ``overlap_comm`` is accepted for symmetry:
    the row backward has no collective that compute could hide. ``wgrad_store``, ``main_grads``: as
    :func:`column_parallel_linear`'s. ``collective_matmul`` (with ``sequence_parallel``): the forward
    reduce-scatter runs as p ring steps, each block's GEMM under the running sum's transfer, and the
    backward all-gather of the output gradient as p ring steps, each chunk's input-gradient GEMM under
    the next chunk's transfer.
    """
    del overlap_comm
    g = resolve_group(group)
    expected_in = weight.shape[1] * (1 if input_is_parallel else g.size)
    _check_inputs(x, weight, bias, expected_in, "row_parallel_linear", sequence_parallel, g)
    _check_ring(collective_matmul, sequence_parallel, "row_parallel_linear")
    plain = wgrad_store is None and main_grads is None
    if g.size == 1 and plain and not _any_autocast():
        return F.linear(x, weight, bias)  # a world of one: exactly nn.Linear, no further Python
    if sequence_parallel and g.size > 1 and x.shape[SEQ_DIM] % g.size != 0:
        raise ValueError(
            f"row_parallel_linear: sequence length {x.shape[SEQ_DIM]} is not divisible by the TP "
            f"degree {g.size} (sequence parallelism splits it across ranks)"
        )
    x, weight, bias = _autocast(x, weight, bias)
    if g.size == 1 and plain:
        return F.linear(x, weight, bias)
    if not input_is_parallel:
        x = scatter_to_tp(x, group=g)
    return _RowParallelLinearFn.apply(x, weight, bias, g, sequence_parallel, wgrad_store,
                                      _check_main_grads(main_grads, weight, bias, "row_parallel_linear", g.size),
                                      collective_matmul)


# ---------------------------------------------------------------------------- split backward: column -> core -> row


def require_chunks(chunks: int, where: str) -> int:
    """``chunks``, or a ValueError naming ``where`` unless it is an integer >= 1."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{where}: chunks must be an integer >= 1, got {chunks!r}")
    return chunks


def _batch_chunks(batch: int, chunks: int) -> List[slice]:
    """``chunks`` contiguous row ranges covering ``range(batch)`` (fewer when the batch is smaller)."""
    n = max(1, min(chunks, batch))
    bounds = [batch * i // n for i in range(n + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def _cat(parts: List[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


def _core_graph(core: Callable[[torch.Tensor, slice], torch.Tensor], h: torch.Tensor, rows: slice):
    """``(h_in, core(h_in, rows))`` with the core's autograd graph from a detached copy ``h_in`` of
    ``h``, for ``torch.autograd.grad`` in a hand-ordered backward (kept from forward: no second SDPA)."""
    with torch.enable_grad():
        h_in = h.detach().requires_grad_()
        return h_in, core(h_in, rows)


def _row_reduce(partial: torch.Tensor, g: TPGroup, sequence_parallel: bool, async_op: bool) -> Pending:
    """This rank's partial sum all-reduced (reduce-scattered along the sequence under SP)."""
    if sequence_parallel:
        return _reduce_scatter(partial, SEQ_DIM, g, async_op=async_op)
    return _all_reduce(partial, g, async_op=async_op)


class _SplitBackwardFn(torch.autograd.Function):
    """``row(core(column(x)))`` as one Function (an MLP: ``core`` = the activation; attention:
    ``core`` = rotary + SDPA over this rank's heads), so its backward orders the two layers' work
    together: the input-gradient chain first (the row layer's, the core's, the column layer's), then
    the column layer's input-gradient collective launched, then BOTH weight gradients under it. The
    Megatron schedule of two separate layers hides that collective under the column layer's weight
    gradient alone: the row layer's ran earlier, with nothing in flight. Same numbers, bit for bit
    (same ops, new order). ``recompute``: the core runs again in backward (cheap activations: its
    output is not kept); otherwise its autograd graph from forward is kept (attention).

    ``rows``: the batch split into chunks (Domino-style forward overlap). Forward runs chunk by chunk
    and launches each chunk's row collective asynchronously, so it travels while the next chunk
    computes; backward likewise launches each chunk's input-gradient collective as soon as that
    chunk's input gradient exists. The weight gradients run once, over all chunks, under the last
    collectives. One chunk is the unchunked schedule above."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, core: Callable, g: TPGroup, sequence_parallel: bool, overlap: bool,
                recompute: bool, rows: List[slice], store: Optional[WeightGradStore], main: MainGrads):
        sp, chunked = sequence_parallel, len(rows) > 1
        gathers = [_all_gather(x[rows[0]], SEQ_DIM, g, async_op=chunked)] if sp else []
        hs, graphs, reducing = [], [], []
        for i, r in enumerate(rows):
            if sp and i + 1 < len(rows):  # the next chunk's input travels while this one computes
                gathers.append(_all_gather(x[rows[i + 1]], SEQ_DIM, g, async_op=True))
            x_full = gathers[i].wait() if sp else x[r]  # (bc, s, hidden)
            h = F.linear(x_full, w1, b1)  # (bc, s, local column width)
            if recompute:
                a = core(h, r)
            else:
                h_in, a = _core_graph(core, h, r)
                graphs.append((h_in, a))
                a = a.detach()
            partial = F.linear(a, w2)  # (bc, s, hidden): this rank's share of the sum
            reducing.append(_row_reduce(partial, g, sp, async_op=chunked))
            hs.append(h)
        out = _cat([pending.wait() for pending in reducing])  # (b, s | s/p, hidden)
        if b2 is not None:
            out = out.add_(b2)
        ctx.save_for_backward(x, w1, b1, w2, b2, *hs)
        ctx.graphs = graphs or None
        ctx.core, ctx.g, ctx.sequence_parallel, ctx.overlap, ctx.rows = core, g, sp, overlap, rows
        ctx.store, ctx.targets, ctx.main = store, ((w1, b1, w2, b2) if store is not None else None), main
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: rebuild it from the differentiable layers
            ctx.graphs = None
            return _split_backward_graph(ctx, grad_out)
        x, w1, b1, w2, b2, *hs = ctx.saved_tensors
        g, sp, overlap, rows = ctx.g, ctx.sequence_parallel, ctx.overlap, ctx.rows
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        grad_full = _all_gather(grad_out, SEQ_DIM, g).wait() if sp else grad_out  # (b, s, hidden)
        defer = ctx.store is not None
        gathering = _all_gather(x, SEQ_DIM, g, async_op=overlap) if (sp and need_w1 and not defer) else None
        graphs, ctx.graphs = ctx.graphs, None
        grad_hs, acts, reducing = [], [], []
        for i, (r, h) in enumerate(zip(rows, hs)):
            # the core's graph from forward, or the core recomputed with one
            h_in, a = _core_graph(ctx.core, h, r) if graphs is None else graphs[i]
            (grad_h,) = torch.autograd.grad(a, h_in, grad_full[r] @ w2)  # (bc, s, local column width)
            grad_hs.append(grad_h)
            acts.append(a.detach())
            if need_x:  # this chunk's partial input gradient (a buffer we own) travels at once
                grad_x = grad_h @ w1
                reducing.append(_row_reduce(grad_x, g, sp, async_op=overlap))
        needs = (need_w1, need_b1 and b1 is not None, need_w2, need_b2 and b2 is not None)
        main = ctx.main
        if defer:  # delay_wgrad: all four weight gradients at flush (under SP, x is gathered then)
            _defer(ctx, ctx.store, ctx.targets, lambda: _region_wgrads(
                grad_full, _cat(acts), _cat(grad_hs), _all_gather(x, SEQ_DIM, g).wait() if sp else x, needs, main, g))
            ctx.targets = None
            grad_x = _cat([pending.wait() for pending in reducing]) if need_x else None
            return grad_x, None, None, None, None, None, None, None, None, None, None, None, None
        x_full = gathering.wait() if gathering is not None else x
        # under the collectives: the row layer's weight gradient, then the column layer's
        grad_w1, grad_b1, grad_w2, grad_b2 = _region_wgrads(grad_full, _cat(acts), _cat(grad_hs), x_full, needs, main, g)
        grad_x = _cat([pending.wait() for pending in reducing]) if need_x else None
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None, None, None, None, None, None


def _region_wgrads(grad_full, act, grad_h, x_full, needs, main: MainGrads, g: TPGroup):
    """The region's weight gradients: the row layer's first, then the column layer's (``main``:
    the four main_grad buffers w1, b1, w2, b2, or None)."""
    need_w1, need_b1, need_w2, need_b2 = needs
    grad_w2, grad_b2 = _linear_wgrads(grad_full, act, need_w2, need_b2, None if main is None else main[2:], g)
    grad_w1, grad_b1 = _linear_wgrads(grad_h, x_full, need_w1, need_b1, None if main is None else main[:2], g)
    return grad_w1, grad_b1, grad_w2, grad_b2


def _split_backward_graph(ctx, grad_out):
    """create_graph=True: the same region through the differentiable column / row ops, unchunked, and
    its gradient (the core runs again: callers keep dropout out of split regions)."""
    x, w1, b1, w2, b2 = ctx.saved_tensors[:5]
    g, sp = ctx.g, ctx.sequence_parallel
    inputs = (x, w1, b1, w2, b2)
    wanted = [i for i, (t, need) in enumerate(zip(inputs, ctx.needs_input_grad[:5])) if need and t is not None]
    h = column_parallel_linear(x, w1, b1, group=g, sequence_parallel=sp)
    out = row_parallel_linear(ctx.core(h, slice(None)), w2, b2, group=g, sequence_parallel=sp)
    grads = torch.autograd.grad(out, [inputs[i] for i in wanted], grad_out, create_graph=True)
    result = [None] * 5
    for i, grad in zip(wanted, grads):
        result[i] = grad
    return (*result, None, None, None, None, None, None, None, None)


def split_backward_region(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: Optional[torch.Tensor],
    w2: torch.Tensor,
    b2: Optional[torch.Tensor],
    core: Callable[[torch.Tensor, slice], torch.Tensor],
    *,
    group: GroupLike,
    sequence_parallel: bool = False,
    overlap_comm: bool = True,
    recompute: bool = False,
    chunks: int = 1,
    wgrad_store: Optional[WeightGradStore] = None,
    main_grads: MainGrads = None,
) -> torch.Tensor:
    """``row(core(column(x)))`` with the split backward of :class:`_SplitBackwardFn`: the column
    layer's input-gradient collective runs under both layers' weight gradients. ``core(h, rows)``
    maps this rank's ``(bc, s, local width)`` columns of the batch rows ``rows`` (a slice of dim 0) to
    the row layer's ``(bc, s, local width)`` input; it must not mix ranks nor draw random numbers.
    ``chunks > 1``: the batch runs in that many chunks (fewer if the batch is smaller), each chunk's
    row collective in flight under the next chunk's compute (forward) and each chunk's input-gradient
    collective under the rest of the backward; results equal the unchunked path up to rounding.
    Shapes as :func:`column_parallel_linear` (``w1``) then :func:`row_parallel_linear` (``w2``); ``x``
    is ``(b, s, hidden)`` (``(b, s/p, hidden)`` with ``sequence_parallel``). ``wgrad_store``: backward
    computes the input-gradient chain only and records the four weight and bias gradients there (as
    :func:`column_parallel_linear`'s); ``main_grads``: the four buffers for w1, b1, w2, b2 (as
    :func:`column_parallel_linear`'s). Under autocast, or in a world of one, it composes the two
    layers instead."""
    g = resolve_group(group)
    require_chunks(chunks, "split_backward_region")
    _check_inputs(x, w1, b1, w1.shape[1], "split_backward_region", sequence_parallel, g)
    if g.size == 1 or autocast_enabled(x):
        h = column_parallel_linear(x, w1, b1, group=g, sequence_parallel=sequence_parallel, overlap_comm=overlap_comm,
                                   wgrad_store=wgrad_store, main_grads=None if main_grads is None else main_grads[:2])
        return row_parallel_linear(core(h, slice(None)), w2, b2, group=g, sequence_parallel=sequence_parallel,
                                   wgrad_store=wgrad_store, main_grads=None if main_grads is None else main_grads[2:])
    if chunks > 1 and x.dim() < 3:
        raise ValueError(f"split_backward_region: chunks={chunks} splits the batch dim of a (b, s, hidden) input, "
                         f"got shape {tuple(x.shape)}")
    _warn_cuda_connections_once(x, g, overlap_comm)
    rows = _batch_chunks(x.shape[0], chunks) if x.dim() >= 3 else [slice(None)]
    if main_grads is not None:
        main_grads = (*_check_main_grads(main_grads[:2], w1, b1, "split_backward_region", g.size),
                      *_check_main_grads(main_grads[2:], w2, b2, "split_backward_region", g.size))
    return _SplitBackwardFn.apply(x, w1, b1, w2, b2, core, g, sequence_parallel, overlap_comm, recompute, rows,
                                  wgrad_store, main_grads)


def parallel_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: Optional[torch.Tensor],
    w2: torch.Tensor,
    b2: Optional[torch.Tensor],
    act: Callable[[torch.Tensor], torch.Tensor],
    *,
    group: GroupLike,
    sequence_parallel: bool = False,
    overlap_comm: bool = True,
    chunks: int = 1,
    wgrad_store: Optional[WeightGradStore] = None,
    main_grads: MainGrads = None,
) -> torch.Tensor:
    """An MLP ``row(act(column(x)))`` with the split backward (:func:`split_backward_region`); the
    activation is recomputed in backward, so the row layer's input is not kept. ``act`` maps this
    rank's ``(..., ffn/p)`` columns (SwiGLU: its local ``[gate_r; up_r]``). ``chunks``: forward overlap
    over batch chunks; ``wgrad_store``: weight gradients recorded for later; ``main_grads``: the four
    accumulation buffers; all as in :func:`split_backward_region`."""
    return split_backward_region(x, w1, b1, w2, b2, lambda h, rows: act(h), group=group,
                                 sequence_parallel=sequence_parallel, overlap_comm=overlap_comm, recompute=True,
                                 chunks=chunks, wgrad_store=wgrad_store, main_grads=main_grads)
