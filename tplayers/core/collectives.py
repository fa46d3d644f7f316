"""The collectives under everything: private primitives that return `Pending` handles (so callers can
overlap them with compute), and public non-differentiable helpers (rebuilding dense weights,
coordination, benchmarks). The differentiable ops built on the primitives are in :mod:`.comm`.

Ownership rule: a primitive that works in place only ever touches a buffer its caller allocated for
it; the public helpers copy (``all_reduce_`` is the one explicit in-place exception).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol  # the compiled paths

from . import accounting
from .groups import GroupLike, TPGroup, collective_device, is_fake, resolve_group
from .placement import Placement

__all__ = ["Pending", "all_gather_tensor", "all_reduce_tensor", "broadcast_tensor", "barrier", "reduce_scatter_tensor",
           "all_reduce_", "gather_placed", "bit_hash", "ranks_that_differ", "all_gather_text"]

# torch 2.13 renamed the single-tensor collectives; 2.4-2.12 only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """A collective in flight. ``wait()`` blocks until it is done and returns its result."""

    __slots__ = ("_work", "_finish", "_result", "_record")

    def __init__(self, work: Optional[object], finish: Callable[[], torch.Tensor],
                 record: Optional[accounting.CommRecord] = None) -> None:
        self._work = work
        self._finish = finish
        self._result: Optional[torch.Tensor] = None
        self._record = record  # set only under comm_accounting / emulated_link

    def wait(self) -> torch.Tensor:
        if self._result is None:
            started = time.perf_counter() if self._record is not None else 0.0
            if self._work is not None:
                self._work.wait()
            if self._record is not None and self._work is not None:
                accounting.finished(self._record, started)
            self._result = self._finish()
        return self._result


def _launch(op: str, nbytes: int, g: TPGroup, call: Callable[[], Any],
            device: Optional[torch.device] = None) -> "tuple[Any, Optional[accounting.CommRecord]]":
    """Run the ``dist`` call; under accounting / an emulated link, also record it (and for a blocking
    call, which returns no work, account its whole duration and sleep out the modeled rest now)."""
    if not accounting.active():
        return call(), None
    t0 = time.perf_counter()
    _INSIDE[0] = True  # torch.distributed may be wrapped too (emulated_link(everywhere=True)): not twice
    try:
        work = call()
    finally:
        _INSIDE[0] = False
    record = accounting.launched(op, nbytes, g.process_group, g.size, t0, device)
    if work is None:
        accounting.finished(record, t0)
    return work, record


_INSIDE = [False]  # a tplayers primitive is calling torch.distributed right now


class _SlowWork:
    """A torch.distributed Work whose ``wait()`` also sleeps until the emulated link's modeled end."""

    def __init__(self, work: Any, end: float) -> None:
        self._work, self._end = work, end

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        _sleep_until(self._end)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _sleep_until(end: float) -> None:
    left = end - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _group_size(group: Any) -> int:
    if isinstance(group, tuple):  # functional collectives: (DeviceMesh, mesh_dim)
        return group[0].size(group[1])
    if hasattr(group, "size") and not isinstance(group, dist.ProcessGroup):  # a 1-D DeviceMesh
        return group.size()
    return dist.get_world_size(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# name -> (op, bytes of the full buffer from (args, result), index of the group argument)
_TORCH_DISTRIBUTED = {
    "all_reduce": ("all_reduce", lambda a, r: _nbytes(a[0]), 2),
    "broadcast": ("broadcast", lambda a, r: _nbytes(a[0]), 2),
    "all_gather_into_tensor": ("all_gather", lambda a, r: _nbytes(a[0]), 2),
    "_all_gather_base": ("all_gather", lambda a, r: _nbytes(a[0]), 2),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, r: _nbytes(a[1]), 3),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, r: _nbytes(a[1]), 3),
}
_FUNCTIONAL = {  # torch.distributed._functional_collectives (DTensor): they return the result tensor
    "all_reduce": ("all_reduce", lambda a, r: _nbytes(a[0]), 2),
    "all_gather_tensor": ("all_gather", lambda a, r: _nbytes(r), 2),
    "all_gather_single": ("all_gather", lambda a, r: _nbytes(r), 2),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, r: _nbytes(a[0]), 3),
    "reduce_scatter_single": ("reduce_scatter", lambda a, r: _nbytes(a[0]), 3),
}


def wrap_torch_distributed(link: Any) -> Callable[[], None]:
    """Route other libraries' collectives through the emulated ``link`` too (DTensor's functional
    collectives, megatron-core's and fairscale's torch.distributed calls): each completes no earlier
    than its modeled end (functional ones block until then: their waits are implicit). Returns the
    function that restores the originals. tplayers' own collectives are not counted twice."""
    import torch.distributed._functional_collectives as funcol

    saved = []

    def install(module: Any, table: Dict[str, Any], functional: bool) -> None:
        for name, (op, nbytes_of, group_at) in table.items():
            original = getattr(module, name, None)
            if original is None:
                continue

            def wrapper(*args: Any, _original: Any = original, _op: str = op, _nbytes_of: Any = nbytes_of,
                        _group_at: int = group_at, **kwargs: Any) -> Any:
                if _INSIDE[0]:
                    return _original(*args, **kwargs)
                t0 = time.perf_counter()
                result = _original(*args, **kwargs)
                group = kwargs.get("group", args[_group_at] if len(args) > _group_at else None)
                end = link.modeled_end(_op, _nbytes_of(args, result), group, _group_size(group), t0)
                if functional or result is None:  # blocking: the caller has it now
                    _sleep_until(end)
                    return result
                return _SlowWork(result, end)

            saved.append((module, name, original))
            setattr(module, name, wrapper)

    install(dist, _TORCH_DISTRIBUTED, False)
    install(funcol, _FUNCTIONAL, True)

    def restore() -> None:
        for module, name, original in saved:
            setattr(module, name, original)

    return restore


def _done(t: torch.Tensor) -> Pending:
    return Pending(None, lambda: t)


def _check_divisible(size: int, g: TPGroup, what: str) -> None:
    if size % g.size != 0:
        raise ValueError(f"{what} of size {size} is not divisible by the TP degree {g.size}")


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


# Under torch.compile the primitives issue torch's functional collectives (``_c10d_functional``):
# they trace into the graph with no break, run asynchronously until ``wait_tensor`` (which
# ``Pending.wait`` calls), so the overlap the schedule asks for survives compilation. In-place
# torch.distributed calls with ``async_op=True`` do not trace (torch 2.13 graph-breaks; torch 2.11's
# dynamo rewrote them and returned a tensor where tplayers expected a Work: wrong numbers).


def _functional_pg(g: TPGroup) -> Any:
    return g.process_group if g.process_group is not None else dist.group.WORLD


# Functional collectives under compile are verified on torch 2.13 (CPU/gloo: same results as eager).
# On torch 2.11 (the lent GPU machine) dynamo mis-traced both forms (in-place: a tensor where a Work
# was due; functional: wrong outputs), so older torch breaks the graph at each collective instead
# and runs it eagerly (the primitives are wrapped in torch.compiler.disable at the end of this module):
# correct, without the collective inside the graph.
_TRACE_COLLECTIVES = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _all_reduce(buf: torch.Tensor, g: TPGroup, *, async_op: bool = False, op: str = "sum") -> Pending:
    """Sum (or ``op="max"``) ``buf`` over the group, in place. ``buf`` must be a contiguous
    tensor the caller owns."""
    if g.size == 1:
        return _done(buf)
    assert buf.is_contiguous(), "all-reduce needs an owned contiguous buffer"
    if _compiling():
        reduced = funcol.all_reduce(buf, op, _functional_pg(g))
        return Pending(None, lambda: buf.copy_(funcol.wait_tensor(reduced)))
    work, record = _launch("all_reduce", buf.numel() * buf.element_size(), g, lambda: dist.all_reduce(
        buf, op=_REDUCE_OPS[op], group=g.process_group, async_op=async_op), buf.device)
    return Pending(work, lambda: buf, record)


def _sum_over_replica_ranks(rows: torch.Tensor, g: TPGroup, num_shards: int) -> torch.Tensor:
    """``rows`` summed over the ranks that hold the same replica of them: the group's ranks in
    ``num_shards`` consecutive runs of ``p // num_shards`` (KV heads replicated over more ranks than
    there are heads). One all-reduce of a ``(num_shards, *rows.shape)`` buffer with this rank's rows
    in its run's slot. Returns a new tensor."""
    slot = g.rank // (g.size // num_shards)
    buf = rows.new_zeros((num_shards,) + tuple(rows.shape))
    buf[slot].copy_(rows)
    return _all_reduce(buf, g).wait()[slot]


def _all_gather(x: torch.Tensor, dim: int, g: TPGroup, *, async_op: bool = False) -> Pending:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    if g.size == 1:
        return _done(x)
    dim = dim % x.dim()
    src = x.contiguous()
    if _compiling():
        gathered = funcol.all_gather_tensor(src, 0, _functional_pg(g))  # (p*d0, ...)
        work, record, result = None, None, lambda: funcol.wait_tensor(gathered)
    else:
        out = torch.empty((g.size * src.shape[0],) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
        work, record = _launch("all_gather", out.numel() * out.element_size(), g,
                               lambda: _all_gather_single(out, src, group=g.process_group, async_op=async_op),
                               out.device)
        result = lambda: out  # noqa: E731
    if dim == 0:
        return Pending(work, result, record)

    def finish() -> torch.Tensor:
        # (p*d0, ...) -> (p, d0, ..., d_dim, ...) -> (d0, ..., p, d_dim, ...) -> merge p into dim
        parts = result().view((g.size,) + tuple(src.shape)).movedim(0, dim)
        shape = list(src.shape)
        shape[dim] *= g.size
        return parts.reshape(shape)

    return Pending(work, finish, record)


def _reduce_scatter(x: torch.Tensor, dim: int, g: TPGroup, *, async_op: bool = False) -> Pending:
    """Sum over the group, then keep this rank's chunk along ``dim``. Never modifies ``x``."""
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
    if dim == 0:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
        work, record = _launch("reduce_scatter", nbytes, g,
                               lambda: _reduce_scatter_single(out, src, group=g.process_group, async_op=async_op),
                               out.device)
        return Pending(work, lambda: out, record)
    chunk_shape = list(src.shape[1:])
    src = src.reshape([g.size * chunk_shape[0]] + chunk_shape[1:])  # the collective splits dim 0
    out = torch.empty(chunk_shape, dtype=x.dtype, device=x.device)
    work, record = _launch("reduce_scatter", nbytes, g,
                           lambda: _reduce_scatter_single(out, src, group=g.process_group, async_op=async_op),
                           out.device)
    return Pending(work, lambda: out.reshape(out_shape), record)



def _ring_exchange(send: torch.Tensor, recv: torch.Tensor, g: TPGroup) -> Pending:
    """Send ``send`` to the next rank of the ring (group rank + 1) and receive the previous rank's
    into ``recv``, asynchronously (one step of a decomposed all-gather / reduce-scatter). Both
    contiguous, same shape on every rank."""
    pg = g.process_group
    nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    if pg is not None:
        nxt, prv = dist.get_global_rank(pg, nxt), dist.get_global_rank(pg, prv)
    ops = [dist.P2POp(dist.isend, send, nxt, group=pg), dist.P2POp(dist.irecv, recv, prv, group=pg)]
    works, record = _launch("send", send.numel() * send.element_size(), g, lambda: dist.batch_isend_irecv(ops),
                            send.device)

    class _All:  # one wait for both directions
        def wait(self) -> None:
            for work in works:
                work.wait()

    return Pending(_All(), lambda: recv, record)

def _split(x: torch.Tensor, dim: int, g: TPGroup) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (torch.chunk order), as an owned contiguous tensor."""
    if g.size == 1:
        return x
    _check_divisible(x.shape[dim], g, f"dim {dim} of a tensor split across the TP group")
    return x.chunk(g.size, dim=dim)[g.rank].contiguous()


def _owned_copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def all_gather_tensor(x: torch.Tensor, dim: int, *, group: GroupLike) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (no autograd). Used to rebuild dense weights."""
    with torch.no_grad():
        return _all_gather(x.detach(), dim, resolve_group(group)).wait()


def all_reduce_tensor(x: torch.Tensor, *, group: GroupLike, op: str = "sum") -> torch.Tensor:
    """Sum (``op="sum"``) or maximum (``op="max"``) of ``x`` over the group as a new tensor
    (no autograd); ``x`` is left untouched."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce_tensor: op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    with torch.no_grad():
        g = resolve_group(group)
        return x.detach() if g.size == 1 else _all_reduce(_owned_copy(x.detach()), g, op=op).wait()


def barrier(group: GroupLike) -> None:
    """Every rank of the group reaches this point before any leaves (a 1-element all-reduce, so it
    runs on any backend and honours the group's timeout)."""
    g = resolve_group(group)
    if g.size > 1:
        all_reduce_tensor(torch.zeros(1, device=collective_device(g.process_group)), group=g)


def reduce_scatter_tensor(x: torch.Tensor, dim: int, *, group: GroupLike) -> torch.Tensor:
    """This rank's chunk (along ``dim``) of the sum of every rank's ``x``, as a new tensor (no autograd)."""
    with torch.no_grad():
        g = resolve_group(group)
        return x.detach() if g.size == 1 else _reduce_scatter(x.detach(), dim, g).wait()


def all_reduce_(x: torch.Tensor, *, group: GroupLike) -> torch.Tensor:
    """Sum ``x`` over the group IN PLACE and return it (no autograd, no copy). Only for a buffer the
    caller owns outright (benchmarks timing the bare collective); everything else uses the copying ops."""
    g = resolve_group(group)
    if g.size == 1:
        return x
    if not x.is_contiguous():
        raise ValueError("all_reduce_: the buffer must be contiguous (a reduction into a copy would be lost)")
    with torch.no_grad():
        return _all_reduce(x, g).wait()


def broadcast_tensor(x: torch.Tensor, src_rank: int, *, group: GroupLike) -> torch.Tensor:
    """``x`` of group rank ``src_rank``, on every rank, as a new tensor (no autograd)."""
    with torch.no_grad():
        g = resolve_group(group)
        if g.size == 1:
            return x.detach()
        buf = _owned_copy(x.detach())
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


def bit_hash(t: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """Two int64 hashes of ``t``'s bits (a plain and a position-weighted wrapping sum), on the CPU:
    equal tensors hash equal; a difference in any bit changes them (but for astronomically rare
    collisions). Works through ``chunk`` elements at a time, so memory stays small for any tensor."""
    flat = t.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[flat.element_size()])
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        bits = flat[start:start + chunk].to(torch.int64)
        weights = torch.arange(start + 1, start + 1 + bits.numel(), dtype=torch.int64, device=bits.device)
        total += torch.stack([bits.sum(), (bits * weights).sum()])
    return total.cpu()


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
    data = text.encode("utf-8")[:limit]
    buf = torch.zeros(limit + 8, dtype=torch.uint8)
    buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    buf[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[8:8]
    every = all_gather_tensor(buf[None].to(collective_device(g.process_group)), 0, group=g).cpu()  # (p, limit + 8)
    out = []
    for row in every:
        n = int(row[:8].clone().view(torch.int64))
        out.append(bytes(row[8:8 + n].tolist()).decode("utf-8", errors="replace"))
    return out


if not _TRACE_COLLECTIVES:  # older torch: dynamo must not trace them (see _TRACE_COLLECTIVES)
    _all_reduce = torch.compiler.disable(_all_reduce)
    _all_gather = torch.compiler.disable(_all_gather)
    _reduce_scatter = torch.compiler.disable(_reduce_scatter)
    _ring_exchange = torch.compiler.disable(_ring_exchange)
    Pending.wait = torch.compiler.disable(Pending.wait)  # type: ignore[method-assign]
