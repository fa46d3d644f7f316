"""The collectives under everything.

Primitives (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``ring_exchange``, ...) return a
`Pending` handle, so callers can overlap them with compute; they are core's own tools (the
differentiable ops of :mod:`.comm` and the schedules of :mod:`.functional` are built on them) and
take a `TPGroup`. The blocking helpers on copies, for any ``group=`` (rebuilding dense weights,
coordination, checks) are :mod:`.blocking`'s.

Ownership rule: a primitive that works in place only ever touches a buffer its caller allocated for
it; the helpers copy (``all_reduce_`` is the one explicit in-place exception).

Core knows nothing of benchmarks: every collective goes through :func:`launch`, the one hook an
`Observer` on the bench floor may watch (with none installed that costs one truth test).

Ranks in step (:mod:`.fingerprint`, beside this path): with the checks on, all-reduce, all-gather and
reduce-scatter carry each rank's fingerprint of the call in ``SLOT`` extra elements of their own buffer
(:mod:`.stamped` lays them out), checked when the collective completes; with them off, the caller's own
buffers travel and nothing of the checks runs. Under torch.compile: torch's functional collectives.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol  # the compiled paths

from . import fingerprint
from .fingerprint import Stamp, bounded_wait, check_lagging, checks_enabled, stamp
from .groups import GroupLike, TPGroup, is_fake, resolve_group
from .stamped import all_gather_buffers, all_reduce_buffers, reduce_scatter_buffers

__all__ = ["Pending", "Observer", "set_observer", "launch", "TRACE_COLLECTIVES", "eager_on_old_torch",
           "REDUCE_OPS", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ring_exchange", "split",
           "owned_copy", "SEQ_DIM", "sum_partials", "wait_for_ranks", "broadcast", "to_rank_major", "from_rank_major",
           "gather_rank_major"]

# Under torch.compile the primitives issue torch's functional collectives (``_c10d_functional``):
# they trace into the graph with no break, run asynchronously until ``wait_tensor`` (which
# ``Pending.wait`` calls), so the overlap the schedule asks for survives compilation. In-place
# torch.distributed calls with ``async_op=True`` do not trace (torch 2.13 graph-breaks; torch 2.11's
# dynamo rewrote them and returned a tensor where tplayers expected a Work: wrong numbers).
# Verified on torch 2.13 (CPU/gloo: same results as eager). On torch 2.11 (the lent GPU machine)
# dynamo mis-traced both forms (in-place: a tensor where a Work was due; functional: wrong outputs),
# so older torch breaks the graph at each collective instead and runs it eagerly: correct, without
# the collective inside the graph.
TRACE_COLLECTIVES = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
eager_on_old_torch = (lambda f: f) if TRACE_COLLECTIVES else torch.compiler.disable


class Pending:
    """A collective in flight. ``wait()`` blocks until it is done and returns its result."""

    __slots__ = ("_work", "_finish", "_result", "_observed", "_stamp")

    def __init__(self, work: Optional[object], finish: Callable[[], torch.Tensor], observed: Any = None,
                 stamp: Optional[Stamp] = None) -> None:
        self._work = work
        self._finish = finish  # for a fingerprinted collective: checks the fingerprints, strips them
        self._result: Optional[torch.Tensor] = None
        self._observed = observed  # (observer, its token) when an observer saw the launch
        self._stamp = stamp  # its fingerprint (the wait is bounded on the CPU)

    @eager_on_old_torch
    def wait(self) -> torch.Tensor:
        if self._result is None:
            started = time.perf_counter() if self._observed is not None else 0.0
            if self._work is not None:  # (a fingerprinted one's wait is bounded on the CPU)
                self._work.wait() if self._stamp is None else self._stamp.wait(self._work)
                if self._observed is not None:
                    self._observed[0].finished(self._observed[1], started)
            self._result = self._finish()
        return self._result


class Observer(Protocol):
    """What watches tplayers' collectives from a floor above (``tplayers.comm_accounting``, the
    emulated link). Installed with :func:`set_observer`; core knows nothing else of it."""

    def launch(self, op: str, nbytes: int, g: TPGroup, device: Optional[torch.device],
               call: Callable[[], Any]) -> Tuple[Any, Any]:
        """Run ``call()`` (the torch.distributed call) and return ``(its work or None, a token)``;
        ``nbytes``: the full buffer (all-gather output, reduce-scatter input; all-to-all: the rows this
        rank sends to the others)."""

    def finished(self, token: Any, wait_started: float) -> None:
        """The caller's ``wait()`` on that collective's work returned (``wait_started``: when it began)."""


_OBSERVER: List[Optional[Observer]] = [None]  # the one hook; None: nothing watches


def set_observer(observer: Optional[Observer]) -> Optional[Observer]:
    """Install ``observer`` (None: remove it); returns the one it replaces."""
    previous, _OBSERVER[0] = _OBSERVER[0], observer
    return previous


def launch(op: str, nbytes: int, g: TPGroup, call: Callable[[], Any],
            device: Optional[torch.device] = None) -> Tuple[Any, Any]:
    """Run the ``dist`` call, through the observer when one is installed: ``(work, observed)``."""
    observer = _OBSERVER[0]
    if observer is None:
        return call(), None
    work, token = observer.launch(op, nbytes, g, device, call)
    return work, (observer, token)


SEQ_DIM = -2  # batch-first activations (b, s, h): the sequence dim is the one before hidden

# Rank-major token order. Under sequence parallelism rank r holds tokens [r*s/p, (r+1)*s/p) of every sequence,
# (b, s/p, h). Gathered along the sequence in batch-first order, (b, s, h), the p chunks interleave with the batch:
# putting them there (or taking a reduce-scatter's blocks from there) copies the whole activation once per
# collective whenever b > 1. Megatron avoids it by keeping activations sequence-first, (s, b, h). Here the
# gathered side keeps the collective's own order, (p, b, s/p, h), "rank-major": the all-gather's buffer as it
# lands and the reduce-scatter's input as it is sent, no copy. A linear is token-wise, so its GEMMs run on that
# order as well as any other; the reordering moves to the layer's per-rank side (its out/p or in/p features
# instead of the hidden size), and costs nothing when b = 1. Which order each pass takes: seq_order.py.


def to_rank_major(t: torch.Tensor, p: int) -> torch.Tensor:
    """``(..., s, f)`` in sequence order -> ``(p, ..., s/p, f)`` contiguous (a copy unless the leading dims are 1)."""
    shape = t.shape[:-2] + (p, t.shape[-2] // p, t.shape[-1])
    return t.reshape(shape).movedim(-3, 0).contiguous()


def from_rank_major(t: torch.Tensor) -> torch.Tensor:
    """``(p, ..., s/p, f)`` -> ``(..., s, f)`` in sequence order (a copy unless the leading dims are 1)."""
    return t.movedim(0, -3).reshape(t.shape[1:-2] + (t.shape[0] * t.shape[-2], t.shape[-1]))


def gather_rank_major(x: torch.Tensor, g: TPGroup, *, async_op: bool = False) -> Pending:
    """Every rank's sequence chunk ``x`` ``(..., s/p, f)`` gathered as ``(p, ..., s/p, f)``: the collective's buffer.
    On the wire, and in its fingerprint, the very gather of ``x`` along the sequence: the token order is a local
    choice (ranks that choose differently still pair their data right, and their checks agree)."""
    return all_gather(x, 0, g, async_op=async_op, stacked=True)


# torch 2.13 renamed the single-tensor collectives; 2.4-2.12 only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

def _done(t: torch.Tensor) -> Pending:
    return Pending(None, lambda: t)


def _settled(pending: Pending, async_op: bool) -> Pending:
    """``pending``, waited on unless ``async_op``: a blocking collective is complete when the call returns (a
    fingerprinted one is launched async, its fingerprints checked at the wait)."""
    if not async_op:
        pending.wait()
    return pending


def _check_divisible(size: int, g: TPGroup, what: str) -> None:
    if size % g.size != 0:
        raise ValueError(f"{what} of size {size} is not divisible by the TP degree {g.size}")


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
REDUCE_OPS = tuple(_REDUCE_OPS)  # the reductions all_reduce takes


_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def _functional(g: TPGroup) -> Any:
    """The process group for torch's functional collectives (a graph being compiled); refuses torch.export
    (``torch.export.export``, and ``torch.distributed.pipelining.pipeline()``, which traces with it): an exported
    program keeps a collective of the forward but not the backward tplayers' autograd Functions give it (the
    input gradient's all-reduce), so its gradients would be silently wrong."""
    if _is_exporting():
        raise RuntimeError(
            "tplayers: a tensor-parallel collective is being traced by torch.export (torch.export.export, or "
            "torch.distributed.pipelining.pipeline()): the exported program would keep the forward collectives "
            "but lose the backward ones tplayers' autograd Functions issue, so its gradients would be wrong. "
            "For pipeline parallelism build each stage by hand with torch.distributed.pipelining.PipelineStage "
            "(docs/models.md, 'Pipeline parallelism'); export the dense model, or the TP model at TP 1 (group=None)")
    return g.process_group if g.process_group is not None else dist.group.WORLD


def _stamp(op: str, nbytes: int, sent: torch.Tensor, g: TPGroup) -> Optional[Stamp]:
    """The collective's fingerprint, or None: checks off (once the group's ranks agreed on that)."""
    if not fingerprint.SETTINGS.enabled and g.process_group in fingerprint.AGREED:
        return None
    return stamp(op, nbytes, sent, g.process_group, g.rank, g.size)


@eager_on_old_torch
def all_reduce(buf: torch.Tensor, g: TPGroup, *, async_op: bool = False, op: str = "sum",
               check_finite: bool = False) -> Pending:
    """Sum (or ``op="max"``) ``buf`` over the group, in place. ``buf`` must be a contiguous
    tensor the caller owns. ``check_finite``: see :func:`sum_partials`."""
    if g.size == 1:
        return _done(buf)
    assert buf.is_contiguous(), "all-reduce needs an owned contiguous buffer"
    if torch.compiler.is_compiling():
        reduced = funcol.all_reduce(buf, op, _functional(g))
        return Pending(None, lambda: buf.copy_(funcol.wait_tensor(reduced)))
    nbytes = buf.numel() * buf.element_size()
    s = _stamp("all_reduce", nbytes, buf, g)  # (a stamped one: async, checked at the wait)
    send, finish = (buf, lambda: buf) if s is None else all_reduce_buffers(buf, s, check_finite)
    work, observed = launch("all_reduce", nbytes, g, lambda: dist.all_reduce(
        send, op=_REDUCE_OPS[op], group=g.process_group, async_op=async_op or s is not None), buf.device)
    return _settled(Pending(work, finish, observed, s), async_op)


@eager_on_old_torch
def all_gather(x: torch.Tensor, dim: int, g: TPGroup, *, async_op: bool = False, stacked: bool = False) -> Pending:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); ``stacked``: along a new leading dim instead,
    ``(p, *x.shape)``."""
    if g.size == 1:
        return _done(x.unsqueeze(0) if stacked else x)
    dim = dim % x.dim()
    src = x.contiguous()
    full = (g.size * src.shape[0],) + tuple(src.shape[1:])
    if torch.compiler.is_compiling():
        gathered = funcol.all_gather_tensor(src, 0, _functional(g))  # (p*d0, ...)
        work, observed, stamped, result = None, None, None, lambda: funcol.wait_tensor(gathered)
    else:
        nbytes = src.numel() * g.size * src.element_size()
        stamped = _stamp("all_gather", nbytes, src, g)
        if stamped is None:
            send, receive = src, torch.empty(full, dtype=src.dtype, device=src.device)
            result = lambda: receive  # noqa: E731
        else:
            send, receive, result = all_gather_buffers(src, full, stamped)
        work, observed = launch("all_gather", nbytes, g, lambda: _all_gather_single(
            receive, send, group=g.process_group, async_op=async_op or stamped is not None), src.device)
    if stacked:
        return _settled(Pending(work, lambda: result().view((g.size,) + tuple(src.shape)), observed, stamped), async_op)
    if dim == 0:
        return _settled(Pending(work, result, observed, stamped), async_op)

    def finish() -> torch.Tensor:
        # (p*d0, ...) -> (p, d0, ..., d_dim, ...) -> (d0, ..., p, d_dim, ...) -> merge p into dim
        parts = result().view((g.size,) + tuple(src.shape)).movedim(0, dim)
        shape = list(src.shape)
        shape[dim] *= g.size
        return parts.reshape(shape)

    return _settled(Pending(work, finish, observed, stamped), async_op)


@eager_on_old_torch
def reduce_scatter(x: torch.Tensor, dim: int, g: TPGroup, *, async_op: bool = False,
                   check_finite: bool = False) -> Pending:
    """Sum over the group, then keep this rank's chunk along ``dim``. Never modifies ``x``.
    ``check_finite``: see :func:`sum_partials`."""
    if g.size == 1:
        return _done(x)
    dim = dim % x.dim()
    _check_divisible(x.shape[dim], g, f"dim {dim} of a reduce-scatter input")
    if dim == 0:
        src = x.contiguous()
    else:  # bring the p chunks of `dim` to the front so each rank's chunk is contiguous: (p * d0, ...), the very
        # buffer (and fingerprint) a caller that made its tokens rank-major sends (sum_partials)
        shape = list(x.shape)
        shape[dim : dim + 1] = [g.size, shape[dim] // g.size]
        src = x.reshape(shape).movedim(dim, 0).contiguous().flatten(0, 1)
    out_shape = list(x.shape)
    out_shape[dim] //= g.size
    nbytes = src.numel() * src.element_size()
    if torch.compiler.is_compiling():  # src: (p*chunk0, ...), rank r's chunk is the r-th block of dim 0
        scattered = funcol.reduce_scatter_tensor(src, "sum", 0, _functional(g))
        return Pending(None, lambda: funcol.wait_tensor(scattered).reshape(out_shape))
    # src: p contiguous blocks, block r = rank r's chunk in out_shape's layout (for dim != 0 too)
    stamped = _stamp("reduce_scatter", nbytes, src, g)
    if stamped is None:
        out = torch.empty(out_shape, dtype=src.dtype, device=src.device)
        send, receive, finish = src.view(-1), out.view(-1), lambda: out
    else:
        send, receive, finish = reduce_scatter_buffers(src, g.size, out_shape, stamped, check_finite)
    work, observed = launch("reduce_scatter", nbytes, g, lambda: _reduce_scatter_single(
        receive, send, group=g.process_group, async_op=async_op or stamped is not None), x.device)
    return _settled(Pending(work, finish, observed, stamped), async_op)


def sum_partials(partial: torch.Tensor, g: TPGroup, sequence_parallel: bool, *, async_op: bool = False,
                 rank_major: bool = False) -> Pending:
    """Every rank's ``partial`` summed (a buffer the caller owns): all-reduced, or under SP reduce-scattered along the
    sequence (``rank_major``: in :func:`to_rank_major`'s order). A float16 forward's partials carry whether each is
    finite with the fingerprint: a split that overflows where the dense sum would not raises on every rank."""
    check = partial.dtype == torch.float16 and torch._C._current_graph_task_id() == -1  # (read only when stamped)
    if sequence_parallel:  # rank-major (p, ..., s/p, f) as (p * ..., s/p, f): rank r's block of dim 0 is partial[r]
        return reduce_scatter(partial.flatten(0, 1) if rank_major else partial, 0 if rank_major else SEQ_DIM, g,
                              async_op=async_op, check_finite=check)
    return all_reduce(partial, g, async_op=async_op, check_finite=check)


class _Bounded:
    """A collective's work whose wait on the CPU is bounded (see :func:`~.fingerprint.bounded_wait`)."""

    __slots__ = ("work", "text")

    def __init__(self, work: Any, text: str) -> None:
        self.work, self.text = work, text

    def wait(self) -> None:
        bounded_wait(self.work, self.text, cpu=True)


@eager_on_old_torch
def all_to_all(x: torch.Tensor, send_rows: Sequence[int], recv_rows: Sequence[int], g: TPGroup, *,
               async_op: bool = False) -> Pending:
    """Rows of ``x`` (dim 0) to every rank of the group, in rank order: the first ``send_rows[0]`` to
    rank 0, the next ``send_rows[1]`` to rank 1 ...; the result holds the rows every rank sent this
    one, rank order (``recv_rows[j]`` from rank j). The sizes must pair up across ranks (rank i's
    ``send_rows[j]`` is rank j's ``recv_rows[i]``): exchange them first, in a checked collective
    (token dispatch all-gathers its counts). Not fingerprinted itself; its wait is bounded on the CPU."""
    send_rows, recv_rows = [int(n) for n in send_rows], [int(n) for n in recv_rows]
    if len(send_rows) != g.size or len(recv_rows) != g.size or sum(send_rows) != x.shape[0]:
        raise ValueError(f"all_to_all: send_rows {send_rows} / recv_rows {recv_rows} must have one size per rank of "
                         f"the group ({g.size}) and send_rows must cover the {x.shape[0]} rows of the input")
    if g.size == 1:
        return _done(x)
    src = x.contiguous()
    if torch.compiler.is_compiling():
        moved = funcol.all_to_all_single(src, recv_rows, send_rows, _functional(g))
        return Pending(None, lambda: funcol.wait_tensor(moved))
    real = not is_fake(g.process_group)
    if real:
        check_lagging(g.process_group, wait=True)  # (a GPU's lagging tables: the split sizes' all-gather, checked now)
    out = torch.empty((sum(recv_rows),) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    row_bytes = src[0:1].numel() * src.element_size() if src.shape[0] else 0
    nbytes = (sum(send_rows) - send_rows[g.rank]) * row_bytes  # what leaves this rank (its own rows stay)
    bounded = real and src.device.type == "cpu" and checks_enabled()
    work, observed = launch("all_to_all", nbytes, g, lambda: dist.all_to_all_single(
        out, src, recv_rows, send_rows, group=g.process_group, async_op=async_op or bounded), src.device)
    if bounded and work is not None:
        work = _Bounded(work, f"all_to_all of {nbytes} bytes, rows sent {send_rows}, received {recv_rows}")
    return _settled(Pending(work, lambda: out, observed), async_op)


@eager_on_old_torch
def ring_exchange(send: torch.Tensor, recv: torch.Tensor, g: TPGroup) -> Pending:
    """Send ``send`` to the next rank of the ring (group rank + 1) and receive the previous rank's
    into ``recv``, asynchronously (one step of a decomposed all-gather / reduce-scatter). Both
    contiguous, same shape on every rank."""
    pg = g.process_group
    nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    if pg is not None:
        nxt, prv = dist.get_global_rank(pg, nxt), dist.get_global_rank(pg, prv)
    # gloo's send / recv hand the tensor's pointer to its TCP transport whatever the device (its collectives
    # stage CUDA tensors through the host, its point-to-point does not): a CUDA tensor failed there with
    # "writev ... Bad address". Such ranks (several sharing one GPU, as tests and `verify --backend gloo` run)
    # exchange host copies.
    staged = send.device.type != "cpu" and dist.get_backend(pg) == "gloo"
    wire_send, wire_recv = (send.cpu(), torch.empty(recv.shape, dtype=recv.dtype)) if staged else (send, recv)
    ops = [dist.P2POp(dist.isend, wire_send, nxt, group=pg), dist.P2POp(dist.irecv, wire_recv, prv, group=pg)]
    works, observed = launch("send", send.numel() * send.element_size(), g, lambda: dist.batch_isend_irecv(ops),
                              send.device)

    class _All:  # one wait for both directions
        def wait(self) -> None:
            for work in works:
                work.wait()
            if staged:
                recv.copy_(wire_recv)

    return Pending(_All(), lambda: recv, observed)


def split(x: torch.Tensor, dim: int, g: TPGroup) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (torch.chunk order), as an owned contiguous tensor."""
    if g.size == 1:
        return x
    _check_divisible(x.shape[dim], g, f"dim {dim} of a tensor split across the TP group")
    return x.chunk(g.size, dim=dim)[g.rank].contiguous()


def owned_copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def wait_for_ranks(group: GroupLike, timeout_s: float, what: str) -> None:
    """Every rank of ``group`` reaches this point within ``timeout_s`` seconds, or a RuntimeError naming
    the ranks that did not come and saying that ``what`` is collective (gloo groups: a monitored
    barrier; other backends have none, and wait as their collectives do)."""
    g = resolve_group(group)
    if g.size == 1 or is_fake(g.process_group) or dist.get_backend(g.process_group) != "gloo":
        return
    try:
        dist.monitored_barrier(g.process_group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        raise RuntimeError(f"{what} is collective: every rank of its group must call it, but not every rank arrived "
                           f"within {timeout_s:g} s ({str(e).splitlines()[0]})") from None


def broadcast(buf: torch.Tensor, src_rank: int, g: TPGroup) -> Pending:
    """``buf`` (a buffer the caller owns) overwritten with group rank ``src_rank``'s, in place; blocking."""
    if g.size == 1:
        return _done(buf)
    src = dist.get_global_rank(g.process_group, src_rank) if g.process_group is not None else src_rank
    work, observed = launch("broadcast", buf.numel() * buf.element_size(), g,
                             lambda: dist.broadcast(buf, src=src, group=g.process_group))
    return Pending(work, lambda: buf, observed)
