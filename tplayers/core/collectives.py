"""The collectives under everything.

Primitives (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``ring_exchange``, ...) return a
`Pending` handle, so callers can overlap them with compute; they are core's own tools (the
differentiable ops of :mod:`.comm` and the schedules of :mod:`.functional` are built on them) and
take a `TPGroup`. Public helpers (``all_gather_tensor`` ...) are non-differentiable, copy, and take
any ``group=``: rebuilding dense weights, coordination, checks.

Ownership rule: a primitive that works in place only ever touches a buffer its caller allocated for
it; the helpers copy (``all_reduce_`` is the one explicit in-place exception).

Core knows nothing of benchmarks: every collective goes through :func:`_launch`, where one
`Observer` (installed by ``tplayers.comm_accounting`` / ``tplayers.emulated_link``, on the bench
floor) may watch it; with none installed that costs one truth test.

Ranks in step (:mod:`.fingerprint`): all-reduce, all-gather and reduce-scatter carry each rank's
fingerprint of the call in ``SLOT`` extra elements of their own buffer (an all-reduce sums in a
reused longer buffer and copies back), checked when the collective completes.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol  # the compiled paths

from .digest import device_hash
from .fingerprint import SLOT, Stamp, bounded_wait, check_lagging, checks_enabled, pack_text, stamp, unpack_texts
from .groups import GroupLike, TPGroup, collective_device, is_fake, resolve_group
from .placement import Placement, holder_slot

__all__ = ["Pending", "Observer", "set_observer", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
           "ring_exchange",
           "sum_over_replica_ranks", "replica_group", "replica_slot", "split", "owned_copy", "all_gather_tensor", "all_reduce_tensor",
           "broadcast_tensor", "barrier", "reduce_scatter_tensor", "all_reduce_", "gather_placed", "bit_hash",
           "bytes_hash", "ranks_that_differ", "all_gather_text", "TRACE_COLLECTIVES", "SEQ_DIM", "sum_partials", "wait_for_ranks"]

SEQ_DIM = -2  # batch-first activations (b, s, h): the sequence dim is the one before hidden

# torch 2.13 renamed the single-tensor collectives; 2.4-2.12 only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

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
_eager_on_old_torch = (lambda f: f) if TRACE_COLLECTIVES else torch.compiler.disable


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

    @_eager_on_old_torch
    def wait(self) -> torch.Tensor:
        if self._result is None:
            started = time.perf_counter() if self._observed is not None else 0.0
            if self._work is not None:
                if self._stamp is not None:
                    self._stamp.wait(self._work)
                else:
                    self._work.wait()
            if self._observed is not None and self._work is not None:
                observer, token = self._observed
                observer.finished(token, started)
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


def _launch(op: str, nbytes: int, g: TPGroup, call: Callable[[], Any],
            device: Optional[torch.device] = None) -> Tuple[Any, Any]:
    """Run the ``dist`` call, through the observer when one is installed: ``(work, observed)``."""
    observer = _OBSERVER[0]
    if observer is None:
        return call(), None
    work, token = observer.launch(op, nbytes, g, device, call)
    return work, (observer, token)


def _done(t: torch.Tensor) -> Pending:
    return Pending(None, lambda: t)


def _settled(pending: Pending, async_op: bool) -> Pending:
    """``pending``, already waited on unless the caller asked for ``async_op``: a blocking collective
    is complete when the call returns. (A fingerprinted collective is always launched async, its
    fingerprints checked at the wait: without this, a caller of a blocking one would run on under
    it, e.g. overlap_comm=False's weight-gradient GEMM.)"""
    if not async_op:
        pending.wait()
    return pending


def _check_divisible(size: int, g: TPGroup, what: str) -> None:
    if size % g.size != 0:
        raise ValueError(f"{what} of size {size} is not divisible by the TP degree {g.size}")


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _functional_pg(g: TPGroup) -> Any:
    return g.process_group if g.process_group is not None else dist.group.WORLD


_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def _compiling() -> bool:
    """Whether torch.compile is tracing; refuses torch.export (``torch.export.export``, and
    ``torch.distributed.pipelining.pipeline()``, which traces with it): an exported program keeps a
    collective of the forward but not the backward tplayers' autograd Functions give it (the input
    gradient's all-reduce), so its gradients would be silently wrong."""
    if _is_exporting():
        raise RuntimeError(
            "tplayers: a tensor-parallel collective is being traced by torch.export (torch.export.export, or "
            "torch.distributed.pipelining.pipeline()): the exported program would keep the forward collectives "
            "but lose the backward ones tplayers' autograd Functions issue, so its gradients would be wrong. "
            "For pipeline parallelism build each stage by hand with torch.distributed.pipelining.PipelineStage "
            "(docs/models.md, 'Pipeline parallelism'); export the dense model, or the TP model at TP 1 (group=None)")
    return torch.compiler.is_compiling()


@_eager_on_old_torch
def all_reduce(buf: torch.Tensor, g: TPGroup, *, async_op: bool = False, op: str = "sum",
               check_finite: bool = False) -> Pending:
    """Sum (or ``op="max"``) ``buf`` over the group, in place. ``buf`` must be a contiguous
    tensor the caller owns. ``check_finite``: see :func:`sum_partials`."""
    if g.size == 1:
        return _done(buf)
    assert buf.is_contiguous(), "all-reduce needs an owned contiguous buffer"
    if _compiling():
        reduced = funcol.all_reduce(buf, op, _functional_pg(g))
        return Pending(None, lambda: buf.copy_(funcol.wait_tensor(reduced)))
    nbytes = buf.numel() * buf.element_size()
    s = _stamp("all_reduce", nbytes, buf, g)
    if s is None:
        work, observed = _launch("all_reduce", nbytes, g, lambda: dist.all_reduce(
            buf, op=_REDUCE_OPS[op], group=g.process_group, async_op=async_op), buf.device)
        return _settled(Pending(work, lambda: buf, observed), async_op)
    n = buf.numel()  # (n data + p * SLOT fingerprint slots: each rank's in its own, zeros elsewhere)
    flat = _scratch(n + s.size * SLOT, buf.dtype, buf.device)
    flat[:n].view(buf.shape).copy_(buf)
    flat[n:].copy_(s.slots(buf.dtype, buf.device, _not_finite(buf) if check_finite else None))
    work, observed = _launch("all_reduce", nbytes, g, lambda: dist.all_reduce(
        flat, op=_REDUCE_OPS[op], group=g.process_group, async_op=True), buf.device)

    def finish() -> torch.Tensor:
        try:
            s.check(flat[n:])
            return buf.copy_(flat[:n].view(buf.shape))
        finally:
            _SCRATCH.append(flat)

    return _settled(Pending(work, finish, observed, s), async_op)


# Fingerprinted all-reduces sum in a longer buffer than the caller's, then copy back. Reused: fresh
# pages cost more than the copy (a 2 MB buffer on the CPU: +2.4 ms fresh, +0.8 ms reused, per all-reduce).
_SCRATCH: List[torch.Tensor] = []


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    for i, t in enumerate(_SCRATCH):
        if t.numel() == numel and t.dtype == dtype and t.device == device:
            return _SCRATCH.pop(i)
    if len(_SCRATCH) >= 8:
        _SCRATCH.pop(0)
    return torch.empty(numel, dtype=dtype, device=device)


def _stamp(op: str, nbytes: int, sent: torch.Tensor, g: TPGroup) -> Optional[Stamp]:
    return stamp(op, nbytes, sent, g.process_group, g.rank, g.size)


def _not_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on ``t``'s device (no synchronization): some element of ``t`` is inf or nan."""
    return ~torch.isfinite(t).all()


def replica_slot(holders: Sequence[int], g: TPGroup, what: str = "replicated rows") -> int:
    """Which replica rank ``g.rank`` holds, the group's ranks held in runs of ``holders[j]`` consecutive
    ranks (KV heads replicated over more ranks than there are heads: ``(2, 2)`` at TP 4, ``(2, 1)`` at
    TP 3); a ValueError naming the layout when it does not cover the group."""
    if not holders or min(holders) < 1 or sum(holders) != g.size:
        raise ValueError(f"{what}: replicas held by {list(holders)} consecutive ranks do not cover the TP group of "
                         f"{g.size} ranks")
    return holder_slot(holders, g.rank)


_REPLICA_GROUPS: dict = {}  # (process group, holders) -> this rank's run as a TPGroup, made once per process


def replica_group(g: TPGroup, holders: Sequence[int]) -> Optional[TPGroup]:
    """The ranks of ``g`` holding the same replica as this rank (its run of ``holders[slot]`` consecutive
    ranks) as a group of their own, made on first use (``new_group(use_local_synchronization=True)``: only
    the run's members take part, every run at once) and kept; a world of one for a run of one. None where
    subgroups cannot be made (a fake group: ``tplayers bench --simulate``): the whole group sums instead."""
    slot = replica_slot(holders, g)
    holders = tuple(int(n) for n in holders)
    key = (g.process_group, holders)
    if key not in _REPLICA_GROUPS:
        if holders[slot] == 1:
            _REPLICA_GROUPS[key] = TPGroup(None, 0, 1)
        elif is_fake(g.process_group) or holders[slot] == g.size:
            _REPLICA_GROUPS[key] = None
        else:
            start = sum(holders[:slot])
            ranks = [dist.get_global_rank(g.process_group, r) for r in range(start, start + holders[slot])]
            sub = dist.new_group(ranks=ranks, backend=dist.get_backend(g.process_group),
                                 use_local_synchronization=True)
            _REPLICA_GROUPS[key] = TPGroup(sub, g.rank - start, holders[slot])
    return _REPLICA_GROUPS[key]


def sum_over_replica_ranks(rows: torch.Tensor, g: TPGroup, holders: Sequence[int]) -> torch.Tensor:
    """``rows`` summed over the ranks that hold the same replica of them: the group's ranks in runs of
    ``holders[j]`` consecutive ranks (see :func:`replica_slot`). One all-reduce over the run's own group
    (:func:`replica_group`: a pair of ranks sends ``rows`` once, where the whole group would send
    ``2(p-1)/p`` of a buffer padded to ``len(holders)`` slots). Returns a new tensor."""
    sub = replica_group(g, holders)
    if sub is not None:
        return owned_copy(rows) if sub.size == 1 else all_reduce(owned_copy(rows), sub).wait()
    slot = replica_slot(holders, g)
    buf = rows.new_zeros((len(holders),) + tuple(rows.shape))
    buf[slot].copy_(rows)
    return all_reduce(buf, g).wait()[slot]


@_eager_on_old_torch
def all_gather(x: torch.Tensor, dim: int, g: TPGroup, *, async_op: bool = False) -> Pending:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    if g.size == 1:
        return _done(x)
    dim = dim % x.dim()
    src = x.contiguous()
    if _compiling():
        gathered = funcol.all_gather_tensor(src, 0, _functional_pg(g))  # (p*d0, ...)
        work, observed, stamped, result = None, None, None, lambda: funcol.wait_tensor(gathered)
    else:
        full = (g.size * src.shape[0],) + tuple(src.shape[1:])
        nbytes = src.numel() * g.size * src.element_size()
        stamped = _stamp("all_gather", nbytes, src, g)
        if stamped is None:
            out = torch.empty(full, dtype=src.dtype, device=src.device)
            work, observed = _launch("all_gather", nbytes, g, lambda: _all_gather_single(
                out, src, group=g.process_group, async_op=async_op), src.device)
            result = lambda: out  # noqa: E731
        else:  # each rank sends (n data + SLOT fingerprint) elements
            n = src.numel()
            ext = torch.cat([src.reshape(-1), stamped.mine(src.dtype, src.device)])
            rows = torch.empty((g.size, n + SLOT), dtype=src.dtype, device=src.device)
            work, observed = _launch("all_gather", nbytes, g, lambda: _all_gather_single(
                rows.view(-1), ext, group=g.process_group, async_op=True), src.device)

            def result() -> torch.Tensor:
                stamped.check(rows[:, n:])
                return rows[:, :n].reshape(full)
    if dim == 0:
        return _settled(Pending(work, result, observed, stamped), async_op)

    def finish() -> torch.Tensor:
        # (p*d0, ...) -> (p, d0, ..., d_dim, ...) -> (d0, ..., p, d_dim, ...) -> merge p into dim
        parts = result().view((g.size,) + tuple(src.shape)).movedim(0, dim)
        shape = list(src.shape)
        shape[dim] *= g.size
        return parts.reshape(shape)

    return _settled(Pending(work, finish, observed, stamped), async_op)


@_eager_on_old_torch
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
    else:  # bring the p chunks of `dim` to the front so each rank's chunk is contiguous
        shape = list(x.shape)
        shape[dim : dim + 1] = [g.size, shape[dim] // g.size]
        src = x.reshape(shape).movedim(dim, 0).contiguous()
    out_shape = list(x.shape)
    out_shape[dim] //= g.size
    nbytes = src.numel() * src.element_size()
    if _compiling():  # src: (p*chunk0, ...), rank r's chunk is the r-th block of dim 0
        src = src.reshape([-1] + list(src.shape[2:])) if dim != 0 else src
        scattered = funcol.reduce_scatter_tensor(src, "sum", 0, _functional_pg(g))
        return Pending(None, lambda: funcol.wait_tensor(scattered).reshape(out_shape))
    # src: p contiguous blocks, block r = rank r's chunk in out_shape's layout (for dim != 0 too)
    m = src.numel() // g.size
    stamped = _stamp("reduce_scatter", nbytes, src, g)
    if stamped is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
        work, observed = _launch("reduce_scatter", nbytes, g, lambda: _reduce_scatter_single(
            out.view(-1), src.view(-1), group=g.process_group, async_op=async_op), x.device)
        return _settled(Pending(work, lambda: out, observed), async_op)
    # every block carries the p fingerprint slots (this rank's in its own), so each rank's chunk of the sum has all
    flag = _not_finite(src) if check_finite else None
    blocks = torch.cat([src.view(g.size, m), stamped.slots(x.dtype, x.device, flag).expand(g.size, -1)], dim=1)
    out = torch.empty(m + g.size * SLOT, dtype=x.dtype, device=x.device)
    work, observed = _launch("reduce_scatter", nbytes, g, lambda: _reduce_scatter_single(
        out, blocks.view(-1), group=g.process_group, async_op=True), x.device)

    def finish() -> torch.Tensor:
        stamped.check(out[m:])
        return out[:m].view(out_shape)

    return _settled(Pending(work, finish, observed, stamped), async_op)


def sum_partials(partial: torch.Tensor, g: TPGroup, sequence_parallel: bool, *, async_op: bool = False) -> Pending:
    """Every rank's ``partial`` summed (a buffer the caller owns): all-reduced, or under sequence
    parallelism reduce-scattered along the sequence (each rank keeps its chunk of the sum).

    In float16, forward: whether each rank's partial is finite travels with the collective's
    fingerprint, so a split that overflows where the dense sum would not raises on every rank (in
    backward, gradients overflow by design under loss scaling, and are left to the scaler)."""
    check = partial.dtype == torch.float16 and torch._C._current_graph_task_id() == -1  # (read only when stamped)
    if sequence_parallel:
        return reduce_scatter(partial, SEQ_DIM, g, async_op=async_op, check_finite=check)
    return all_reduce(partial, g, async_op=async_op, check_finite=check)


class _Bounded:
    """A collective's work whose wait on the CPU is bounded (see :func:`~.fingerprint.bounded_wait`)."""

    __slots__ = ("work", "text")

    def __init__(self, work: Any, text: str) -> None:
        self.work, self.text = work, text

    def wait(self) -> None:
        bounded_wait(self.work, self.text, cpu=True)


@_eager_on_old_torch
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
    if _compiling():
        moved = funcol.all_to_all_single(src, recv_rows, send_rows, _functional_pg(g))
        return Pending(None, lambda: funcol.wait_tensor(moved))
    real = not is_fake(g.process_group)
    if real:
        check_lagging(g.process_group)  # (a GPU's lagging table: the split sizes' all-gather, checked now)
    out = torch.empty((sum(recv_rows),) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    row_bytes = src[0:1].numel() * src.element_size() if src.shape[0] else 0
    nbytes = (sum(send_rows) - send_rows[g.rank]) * row_bytes  # what leaves this rank (its own rows stay)
    bounded = real and src.device.type == "cpu" and checks_enabled()
    work, observed = _launch("all_to_all", nbytes, g, lambda: dist.all_to_all_single(
        out, src, recv_rows, send_rows, group=g.process_group, async_op=async_op or bounded), src.device)
    if bounded and work is not None:
        work = _Bounded(work, f"all_to_all of {nbytes} bytes, rows sent {send_rows}, received {recv_rows}")
    return _settled(Pending(work, lambda: out, observed), async_op)


@_eager_on_old_torch
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
    works, observed = _launch("send", send.numel() * send.element_size(), g, lambda: dist.batch_isend_irecv(ops),
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


def all_gather_tensor(x: torch.Tensor, dim: int, *, group: GroupLike) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (no autograd). Used to rebuild dense weights."""
    with torch.no_grad():
        return all_gather(x.detach(), dim, resolve_group(group)).wait()


def all_reduce_tensor(x: torch.Tensor, *, group: GroupLike, op: str = "sum") -> torch.Tensor:
    """Sum (``op="sum"``) or maximum (``op="max"``) of ``x`` over the group as a new tensor
    (no autograd); ``x`` is left untouched."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce_tensor: op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    with torch.no_grad():
        g = resolve_group(group)
        return x.detach() if g.size == 1 else all_reduce(owned_copy(x.detach()), g, op=op).wait()


def barrier(group: GroupLike) -> None:
    """Every rank of the group reaches this point before any leaves (a 1-element all-reduce, so it
    runs on any backend and honours the group's timeout)."""
    g = resolve_group(group)
    if g.size > 1:
        all_reduce_tensor(torch.zeros(1, device=collective_device(g.process_group)), group=g)


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


def reduce_scatter_tensor(x: torch.Tensor, dim: int, *, group: GroupLike) -> torch.Tensor:
    """This rank's chunk (along ``dim``) of the sum of every rank's ``x``, as a new tensor (no autograd)."""
    with torch.no_grad():
        g = resolve_group(group)
        return x.detach() if g.size == 1 else reduce_scatter(x.detach(), dim, g).wait()


def all_reduce_(x: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """Sum ``x`` over the group IN PLACE and return it (no autograd, no copy). Only for a buffer the
    caller owns outright (benchmarks timing the bare collective); everything else uses the copying ops."""
    g = resolve_group(group)
    if g.size == 1:
        return x
    if not x.is_contiguous():
        raise ValueError("all_reduce_: the buffer must be contiguous (a reduction into a copy would be lost)")
    with torch.no_grad():
        return all_reduce(x, g).wait()


def broadcast_tensor(x: torch.Tensor, src_rank: int, *, group: GroupLike) -> torch.Tensor:
    """``x`` of group rank ``src_rank``, on every rank, as a new tensor (no autograd)."""
    with torch.no_grad():
        g = resolve_group(group)
        if g.size == 1:
            return x.detach()
        buf = owned_copy(x.detach())
        src = dist.get_global_rank(g.process_group, src_rank) if g.process_group is not None else src_rank
        _launch("broadcast", buf.numel() * buf.element_size(), g, lambda: dist.broadcast(buf, src=src, group=g.process_group))
        return buf


def gather_placed(local: torch.Tensor, placement: Placement, *, group: GroupLike) -> torch.Tensor:
    """The dense tensor of ``placement`` rebuilt on every rank from each rank's ``local`` (no
    autograd). A replicated placement returns ``local`` itself: no communication."""
    if not placement.is_sharded:
        return local.detach()
    g = resolve_group(group)
    gathered = all_gather_tensor(local.contiguous(), placement.dim, group=g)
    return placement.unshard(gathered.chunk(g.size, dim=placement.dim))


def bit_hash(t: torch.Tensor) -> torch.Tensor:
    """Two int64 hashes of ``t``'s bits (a plain and a position-weighted wrapping sum), on the CPU:
    equal tensors hash equal; a difference in any bit changes them (but for astronomically rare
    collisions). Works through 1M elements at a time, so memory stays small for any tensor."""
    return device_hash(t).cpu()


def bytes_hash(data: bytes) -> torch.Tensor:
    """:func:`bit_hash` of raw bytes (a path, a file's text): two int64, equal on every rank for equal bytes
    (unlike Python's ``hash`` of a str, which is salted per process)."""
    return bit_hash(torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8))


def ranks_that_differ(hashes: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """Every rank's ``hashes`` (n, k) gathered (one all-gather): ``(p, n)`` bool, True where a rank's
    row differs from rank 0's. The same answer on every rank, so all raise together."""
    g = resolve_group(group)
    if g.size == 1 or is_fake(g.process_group):  # a simulated group has no peers to disagree
        return torch.zeros(1, hashes.shape[0], dtype=torch.bool)
    every = all_gather_tensor(hashes[None].to(collective_device(g.process_group)), 0, group=g).cpu()  # (p, n, k)
    return (every != every[:1]).any(-1)


def all_gather_text(text: str, *, group: GroupLike, limit: int = 8192) -> "list[str]":
    """Every rank's ``text`` (UTF-8, cut to ``limit`` bytes), in rank order, on every rank: one
    all-gather of ``limit + 8`` bytes per rank. For errors that one rank found and every rank raises."""
    g = resolve_group(group)
    if g.size == 1 or is_fake(g.process_group):
        return [text]
    buf = pack_text(text, limit)
    return unpack_texts(all_gather_tensor(buf[None].to(collective_device(g.process_group)), 0, group=g).cpu())


