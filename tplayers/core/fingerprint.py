"""Ranks in step: every collective tplayers issues is the same collective on every rank of its group.

A collective pairs with whatever the other ranks issue next. A rank that runs one extra forward
(evaluation on rank 0 only), skips a backward, or retries a step after catching an exception pairs
its all-reduce with another layer's, or another phase's, on the other ranks: the shapes agree, the
sums are wrong, nothing fails. So each collective carries a fingerprint of itself:

    op · bytes · shape · dtype · phase · train / autograd mode · issuing module · position

(phase: forward or backward; issuing module: in forward the innermost module running, by its path in
the model; in backward the autograd node, and the collective's position in this backward), hashed
to 8 bytes and sent IN the collective's own buffer: ``SLOT`` = 13 extra elements per rank holding
values 0..255 (exact in every floating and integer dtype; in an all-reduce each rank writes its own slot, the others' are zero, so the
sum is every rank's fingerprint; a reduce-scatter carries the slots in every rank's chunk), plus one
flag element: a float16 forward partial sum that is not finite (the split can overflow where the dense
sum does not), raised as FloatingPointError on every rank naming the layer; plus ``CARRIED`` = 4 bytes
of the digest of the state the ranks must share while the collective runs (:func:`.carried.carry`: a TP model's
inputs, random generators and replicated parameters during its forward, a vocabulary-parallel loss's
targets), computed on the device, so a rank that drifted (a batch of its own from step 2, a per-rank
reseed, a scaler that stepped on one rank only) raises :class:`RanksDiverged` on every rank, naming the
argument, generator or parameter that differs (one more exchange, on the error path only). When the
collective completes, every rank holds every rank's fingerprint; any difference raises
`CollectivesOutOfStep` on every rank, naming each rank's side (one extra all-gather of the
descriptions, on the error path only). The group stays usable. No extra round trip: the cost is a
copy of the buffer into a slightly longer one (and back), measured in benchmarks/RESULTS.md.

On the CPU a rank waits at most ``timeout`` seconds at a checked collective, then raises naming the
call (a rank that raised and went on, instead of the process group's 30 minutes in silence). On a
GPU the fingerprints are copied to the host without a synchronization and checked at a later launch of
the group's collectives, once the GPU has written them (an event queried, never waited for: the host
keeps running ahead of the device); a group lets at most ``MAX_LAGGING`` tables wait, then waits for
its oldest (the same call on every rank: each rank's checks run at the same collectives).

Not covered: point-to-point ring steps (``collective_matmul``) and broadcasts, all-to-alls (token dispatch:
their split sizes travel first in a checked all-gather, whose table an all-to-all checks before it launches,
on a GPU too; their wait is bounded on the CPU), collectives inside a
``torch.compile`` graph, groups of the ``fake`` backend (simulation), a collective whose SIZE differs
across ranks (the backend itself fails on it: gloo aborts, NCCL may hang), collectives other code
issues on the group. Off: ``tplayers.set_collective_checks(False)`` or ``TPLAYERS_COLLECTIVE_CHECKS=0``.
"""
from __future__ import annotations

import os
import socket
import sys
import time
import weakref
import zlib
from dataclasses import dataclass
from datetime import timedelta
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .carried import CARRIED, Shared, carried, diverged_message, entries_text, forget
from .sites import forward_site
from .group_store import waiting_note

__all__ = ["CollectivesOutOfStep", "RanksDiverged", "set_collective_checks", "SETTINGS", "AGREED", "Stamp", "stamp",
           "bounded_wait", "checks_enabled", "check_lagging", "SLOT", "exchange_text",
           "pack_text", "unpack_texts"]

DIGEST = 8  # 8 bytes of fingerprint, one byte per element
SLOT = DIGEST + 1 + CARRIED  # per rank: the digest, 1 where its float16 partial sum is not finite, the carried bytes
_TEXT = 1024  # bytes per rank of the description exchanged after a mismatch
_UNSTAMPED = {torch.bool, torch.complex64, torch.complex128} | {  # no 0..255 integers in these
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)}


class CollectivesOutOfStep(RuntimeError):
    """The ranks of a TP group issued different collectives (raised on every rank of the group)."""


class RanksDiverged(RuntimeError):
    """The ranks of a TP group issued the same collective, but what they must share differs: the model's
    inputs, its random generators, its replicated parameters, a loss's targets (raised on every rank)."""


@dataclass
class _Settings:
    enabled: bool
    timeout: float


SETTINGS = _Settings(enabled=os.environ.get("TPLAYERS_COLLECTIVE_CHECKS", "1") != "0", timeout=600.0)


def set_collective_checks(enabled: bool = True, *, timeout: float = 600.0) -> Tuple[bool, float]:
    """Check (default) or stop checking that every rank of a group issues the same collective;
    ``timeout``: seconds a rank waits at one checked collective (CPU) before it raises, naming the
    call. Process-wide; returns the previous ``(enabled, timeout)``. Called alike on every rank: each group compares
    the setting again at its next collective (a tool restoring a node's own TPLAYERS_COLLECTIVE_CHECKS=0, named)."""
    if timeout <= 0:
        raise ValueError(f"set_collective_checks: timeout={timeout} must be > 0 seconds")
    previous = (SETTINGS.enabled, SETTINGS.timeout)
    SETTINGS.enabled, SETTINGS.timeout = bool(enabled), float(timeout)
    AGREED.clear()
    return previous


class _Group:
    """One group's count of checked collectives, its backward position, and (GPU) the fingerprint
    table of its last collective, still to be checked."""

    def __init__(self) -> None:
        self.seq = 0
        self.task = -1  # the backward (graph task) the last collective ran in
        self.position = 0
        self.lagging: Deque[Tuple[torch.Tensor, Any, "Stamp"]] = deque()  # oldest first
        self.fake: Optional[bool] = None  # a simulated group (the fake backend): not checked


_GROUPS: "weakref.WeakKeyDictionary[Any, _Group]" = weakref.WeakKeyDictionary()
AGREED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # groups whose ranks compared their settings (first collective)
_LAG_ON_CPU = [False]  # tests: check CPU tables one collective late, as on a GPU
MAX_LAGGING = 64  # a GPU's fingerprint tables a group lets wait for the device before it waits for the oldest


def _crc(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


# A call site's slots on its device, made once (its digest is the same every step): no host tensor, no copy to the
# device per collective. Bounded: a program whose sites keep changing (shapes that vary) is cleared now and then.
_SLOT_TENSORS: Dict[Tuple[Any, ...], torch.Tensor] = {}


def _cached(key: Tuple[Any, ...], build: Callable[[], torch.Tensor]) -> torch.Tensor:
    out = _SLOT_TENSORS.get(key)
    if out is None:
        if len(_SLOT_TENSORS) >= 4096:
            _SLOT_TENSORS.clear()
        out = _SLOT_TENSORS[key] = _to_device(build(), key[-1])
    return out


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a synchronization: a copy from pageable memory would wait for the
    device's stream (torch synchronizes it); from pinned memory it is queued like a kernel."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class Stamp:
    """One collective's fingerprint on this rank: what it writes into the buffer, and the check of
    the table every rank's slots come back as."""

    __slots__ = ("digest", "rank", "size", "pg", "_text", "site", "cpu", "shared", "carried")

    def __init__(self, digest: List[int], rank: int, size: int, pg: Any, text: Union[str, Callable[[], str]],
                 site: str, cpu: bool, shared: Tuple[Shared, ...] = (), carried: Optional[torch.Tensor] = None) -> None:
        self.digest, self.rank, self.size, self.pg, self.site, self.cpu = digest, rank, size, pg, site, cpu
        self._text = text  # (or how to write it: only an error or a timeout reads it)
        self.shared, self.carried = shared, carried  # what this rank carries: its state, its CARRIED bytes

    @property
    def text(self) -> str:
        """This collective on this rank, in words (for the messages)."""
        if callable(self._text):
            self._text = self._text()
        return self._text

    def mine(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This rank's ``SLOT`` elements (its flag 0)."""
        base = _cached(("mine", tuple(self.digest), dtype, device),
                       lambda: torch.tensor(self.digest + [0] * (1 + CARRIED), dtype=dtype))
        if self.carried is None:
            return base
        out = base.clone()
        out[DIGEST + 1:] = self.carried
        return out

    def slots(self, dtype: torch.dtype, device: torch.device, overflow: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``size * SLOT`` elements: this rank's digest (and ``overflow``, a 0-d bool: its float16
        partial sum is not finite) in its slot, zeros elsewhere: summed over the group, every rank's.
        (Read only: the same tensor may be handed out again, for the same call site.)"""
        def build() -> torch.Tensor:
            out = torch.zeros(self.size * SLOT, dtype=dtype)
            out[self.rank * SLOT:self.rank * SLOT + DIGEST] = torch.tensor(self.digest, dtype=dtype)
            return out
        out = _cached(("slots", tuple(self.digest), self.rank, self.size, dtype, device), build)
        if overflow is None and self.carried is None:
            return out
        out = out.clone()
        if overflow is not None:  # stays on the device: no synchronization
            out[self.rank * SLOT + DIGEST] = overflow.to(dtype)
        if self.carried is not None:  # (a device copy: no synchronization either)
            out[self.rank * SLOT + DIGEST + 1:(self.rank + 1) * SLOT] = self.carried
        return out

    def wait(self, work: Any) -> None:
        """Wait for ``work``: on the CPU at most the configured timeout, then raise naming this call."""
        bounded_wait(work, lambda: self.text, self.cpu, self.pg)

    def check(self, table: torch.Tensor) -> None:
        """``table``: the ``size * SLOT`` fingerprint elements every rank received. On the CPU checked
        now; on a GPU copied to the host without a sync and checked at the group's next collective."""
        if table.device.type == "cpu" and not _LAG_ON_CPU[0]:
            _verify(table, self)
            return
        host = torch.empty(table.shape, dtype=table.dtype, pin_memory=table.device.type == "cuda")
        host.copy_(table, non_blocking=True)
        event = None
        if table.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        _group(self.pg).lagging.append((host, event, self))


def _agree_on_checks(pg: Any, size: int) -> None:
    """At a group's first collective, every rank's setting (one raw all-gather of one integer, once): a checked
    collective's buffer is ``SLOT`` elements per rank longer than an unchecked one's, so ranks that disagree
    would pair buffers of different sizes (gloo aborts a rank; NCCL may hang). Raised on every rank."""
    AGREED.add(pg)
    if dist.get_backend(pg) == "fake":
        return
    from .groups import collective_device

    device = collective_device(pg)
    every = torch.empty(size, dtype=torch.int64, device=device)
    _gather(every, torch.tensor([int(SETTINGS.enabled)], dtype=torch.int64, device=device), pg)
    on = every.cpu().tolist()
    if len(set(on)) > 1:
        AGREED.discard(pg)  # (still unsettled: the next collective asks again)
        raise CollectivesOutOfStep(
            f"tplayers: collective checks are on on rank(s) {[r for r, v in enumerate(on) if v]} and off on rank(s) "
            f"{[r for r, v in enumerate(on) if not v]} of this TP group: a checked collective carries {SLOT} more "
            "elements per rank than an unchecked one, so the ranks' buffers would not match (gloo aborts a rank, "
            "NCCL may hang). Set TPLAYERS_COLLECTIVE_CHECKS, or call tplayers.set_collective_checks(...), alike on "
            "every rank (compared at each group's first collective, and again after every set_collective_checks call)")


def _group(pg: Any) -> _Group:
    state = _GROUPS.get(pg)
    if state is None:
        state = _GROUPS[pg] = _Group()
    return state


def _where_this_rank_runs() -> str:
    """``global rank 3 on node-b``: what an error on a large job names beside the rank in the TP group."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"global rank {rank} on {socket.gethostname()}"


def _verify(table: torch.Tensor, s: Stamp, late: bool = False) -> None:
    """Compare every rank's fingerprint in ``table`` (in host memory: read once, as Python integers)."""
    rows = table.reshape(s.size, SLOT).tolist()  # (small integers, exact in every stamped dtype)
    overflowed = [rank for rank, row in enumerate(rows) if row[DIGEST]]
    if any(row[:DIGEST] != s.digest for row in rows):
        sides = exchange_text(s.text, s.pg, s.size)
        fate = ("It was checked when the group's next collective launched (a GPU's fingerprints reach the host "
                "without a synchronization): its result may have been used." if late else
                "The collective's result was discarded.")
        raise CollectivesOutOfStep(
            "tplayers: the ranks of a TP group are out of step: they issued different collectives, which pair one "
            "rank's data with another layer's or phase's and compute wrong numbers. Every rank must run the same "
            "forward and backward calls on the model (evaluation on every rank, not on rank 0 only; no rank skipping "
            "or retrying a step alone). " + fate + "\n  " + "\n  ".join(sides))
    carried = [row[DIGEST + 1:] for row in rows]
    if any(c != carried[0] for c in carried):
        texts = exchange_text(entries_text(s.shared, _where_this_rank_runs()), s.pg, s.size, limit=None)
        forget(s.pg)  # (nothing of the abandoned step rides on)
        raise RanksDiverged(diverged_message(s.shared, texts, s.text, late))
    if overflowed:
        raise FloatingPointError(
            f"tplayers: float16 overflow in the row-parallel sum at {s.site}: the partial sum of rank(s) {overflowed} "
            "is not finite. Each rank sums only its shard's products before the all-reduce, and in float16 (largest "
            "65504) a partial can overflow where the dense sum does not (partials +70000 and -60000, dense 10000). Use "
            "bfloat16 (float32's range) for this model, or scale this layer's inputs down (if they are themselves not "
            "finite, that is the cause to fix). Checked on every rank with the collective's fingerprints "
            "(tplayers.set_collective_checks)")


def checks_enabled() -> bool:
    """Whether collectives are checked (:func:`set_collective_checks`)."""
    return SETTINGS.enabled


def bounded_wait(work: Any, text: Union[str, Callable[[], str]], cpu: bool, pg: Any = None) -> None:
    """Wait for ``work`` (the collective ``text`` describes, or ``text()``: written only if it is needed): on the
    CPU at most the configured timeout, then raise naming it (and what a rank of ``pg`` waiting at a store barrier
    said: :func:`~.group_store.waiting_note`); elsewhere as the backend waits."""
    if not cpu:
        work.wait()
        return
    started = time.monotonic()
    try:
        work.wait(timeout=timedelta(seconds=SETTINGS.timeout))
    except RuntimeError as e:
        waited, cause = time.monotonic() - started, str(e).splitlines()[0]
        text = text() if callable(text) else text
        cause += f". Meanwhile {note}" if (note := waiting_note(pg)) else ""  # (a store barrier's reader, waiting)
        if waited < 0.5 * SETTINGS.timeout:  # cut short: a peer's connection closed, nobody waited the timeout out
            raise CollectivesOutOfStep(
                f"tplayers: this collective ({text}) failed after {waited:.1f} s (of the {SETTINGS.timeout:g} s "
                "allowed): another rank of the TP group closed its connection (it exited, or stopped on an error of "
                f"its own: look at that rank's output first). ({cause})") from None
        raise CollectivesOutOfStep(
            f"tplayers: waited {SETTINGS.timeout:g} s for the other ranks of the TP group at this collective "
            f"({text}); not every rank issued it: a rank stopped issuing the model's collectives (it "
            "raised and went on, skipped a step, or is busy elsewhere). Set a longer wait with "
            f"tplayers.set_collective_checks(timeout=...). ({cause})") from None


def check_lagging(pg: Any, wait: bool = False) -> None:
    """Check the group's earlier fingerprinted collectives whose tables have reached the host (a GPU's, checked
    at a later launch of the group's collectives: this is one). Never waits for the device unless ``wait`` (every
    table checked now) or more than ``MAX_LAGGING`` tables wait (the oldest is waited for). Each rank's device
    finishes the same collectives, but not at the same moment: a table not yet written on one rank may be checked
    later there, so a mismatch raises on every rank within the group's next ``MAX_LAGGING`` collectives."""
    state = _GROUPS.get(pg)
    lagging = None if state is None else state.lagging
    while lagging:
        host, event, previous = lagging[0]
        if event is not None and not event.query():
            if not wait and len(lagging) <= MAX_LAGGING:
                return
            event.synchronize()
        lagging.popleft()
        _verify(host, previous, late=True)


def stamp(op: str, nbytes: int, sent: torch.Tensor, pg: Any, rank: int, size: int) -> Optional[Stamp]:
    """The fingerprint of a collective on ``pg`` about to be launched (``sent``: the tensor this rank
    contributes), or None when it is not checked. First checks the group's previous collective if its
    table is still pending (GPU)."""
    if size == 1:
        return None
    if pg not in AGREED:
        _agree_on_checks(pg, size)
    if not SETTINGS.enabled or sent.dtype in _UNSTAMPED:
        return None
    state = _group(pg)
    if state.fake is None:
        state.fake = dist.get_backend(pg) == "fake"
    if state.fake:
        return None
    check_lagging(pg)
    task = torch._C._current_graph_task_id()
    backward = task != -1
    if backward:
        if task != state.task:
            state.task, state.position = task, 0
        else:
            state.position += 1
        node = torch._C._current_autograd_node()
        site, training, tracked = (node.name() if node is not None else "(autograd)"), True, True
    else:
        site, training, tracked = forward_site(sys._getframe(2))
    state.seq += 1
    shape, dtype = tuple(sent.shape), str(sent.dtype).replace("torch.", "")
    what = f"{op}|{nbytes}|{dtype}|{shape}|{int(backward)}|{int(training)}{int(tracked)}|{state.position if backward else -1}"
    digest = list((_crc(what).to_bytes(4, "little") + _crc(site).to_bytes(4, "little")))
    seq, position = state.seq, state.position

    def text() -> str:  # (written only when a message needs it)
        where = (f"in {site}, collective {position + 1} of this backward" if backward
                 else f"at {site} ({'training' if training else 'eval'} mode, autograd {'on' if tracked else 'off'})")
        return f"rank {dist.get_rank()}: {'backward' if backward else 'forward'} {op} #{seq} of {shape} {dtype} {where}"
    shared, carried_bytes = carried(pg, sent.dtype, sent.device)
    return Stamp(digest, rank, size, pg, text, site, sent.device.type == "cpu", shared, carried_bytes)


def exchange_text(text: str, pg: Any, size: int, limit: Optional[int] = _TEXT - 2) -> List[str]:
    """Every rank's ``text``, cut to ``limit`` bytes (None: whole, after one more exchange of the lengths).
    Raw ``torch.distributed`` calls, not checked: for error paths, where every rank found the same fault."""
    from .groups import collective_device

    device = collective_device(pg)
    if limit is None:
        lengths = torch.empty(size, dtype=torch.int64, device=device)
        _gather(lengths, torch.tensor([len(text.encode("utf-8"))], dtype=torch.int64, device=device), pg)
        limit = int(lengths.max())
    every = torch.empty(size * (limit + 8), dtype=torch.uint8, device=device)
    _gather(every, pack_text(text, limit).to(device), pg)
    return unpack_texts(every.cpu().view(size, limit + 8))


def pack_text(text: str, limit: int) -> torch.Tensor:
    """``text`` as ``limit + 8`` bytes: its UTF-8 length (int64), then the bytes, cut to ``limit``."""
    data = text.encode("utf-8")[:limit]
    buf = torch.zeros(limit + 8, dtype=torch.uint8)
    buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if data:
        buf[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def unpack_texts(rows: torch.Tensor) -> List[str]:
    """Every row of :func:`pack_text` bytes (``(p, limit + 8)``, on the CPU) back as text."""
    return [bytes(row[8:8 + int(row[:8].clone().view(torch.int64))].tolist()).decode("utf-8", errors="replace")
            for row in rows]


def _gather(out: torch.Tensor, mine: torch.Tensor, pg: Any) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, mine, group=pg)
