"""Comm accounting and link emulation: what every tplayers collective moved, and when.

`comm_accounting()` (like DTensor's ``CommDebugMode``) records each collective tplayers issues: op,
bytes (the full buffer, see :mod:`.link`), group size, phase (forward / backward), the issuing
module (forward: the innermost module running; backward: the autograd node) and how long the
caller was blocked in the launch call and in ``wait()`` (the exposed part of that collective, as the
host saw it: on CUDA,
where ``wait()`` does not block the host, that is the stream-ordering time, not the GPU's).

`emulated_link(spec)` makes every collective complete, as ``wait()`` (or a blocking call) sees it,
no earlier than its modeled end: launch (or the end of the previous collective on the same group:
one link, collectives in order) + `LinkModel.seconds`, sleeping (no CPU) for the rest. The data
still moves over the real backend, so results stay exact. It covers the collectives tplayers
issues (core/collectives.py); other libraries' collectives (DTensor, megatron-core) are not slowed.

On CUDA the link lives on the GPU's timeline instead, as NCCL does: each collective is a
``torch.cuda._sleep`` of its modeled duration on a link stream (one per device and group, so
collectives queue in order), started when the launching stream reaches the launch, and ``wait()``
makes the current stream wait for its end, without blocking the host. Under ``comm_accounting`` the
times are then read from CUDA events when the context exits (one synchronize): launch, the point the
waiting stream reached, the end; blocked = how long the stream stalled. The sleep kernel occupies
one block of one SM while it runs (NCCL's kernels take more). With ``CUDA_DEVICE_MAX_CONNECTIONS=1``
(one hardware queue) the waiting stream's event is queued behind the link's end, so the stall still
happens but is counted as compute: measure exposure with the default (several queues).

Both are context managers holding explicit objects. They watch core's collectives through core's
one observer hook (`tplayers.core.collectives.set_observer`), installed while any is active and
removed after: when none is, a collective costs core one truth test.

``acct.against(budget)`` holds the records against what a layout must communicate
(:mod:`.budget`: `megatron_budget`; :mod:`.hf_budget`: `megatron_budget_for_hf`), per phase and collective.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..core import collectives
from ..core.fingerprint import set_collective_checks
from ..core.groups import TPGroup
from .budget import BudgetComparison, CommBudget
from .everywhere import sleep_until, wrap_torch_distributed
from .link import LinkModel, parse_link

__all__ = ["CommRecord", "CommAccounting", "comm_accounting", "EmulatedLink", "emulated_link"]

_ACTIVE: List[Any] = []  # the CommAccounting / EmulatedLink objects now active (innermost last)


@dataclass
class CommRecord:
    """One collective: what, where, and its times (``time.perf_counter`` seconds)."""

    op: str  # all_reduce | all_gather | reduce_scatter | broadcast
    nbytes: int  # the full buffer (all-gather output, reduce-scatter input); all-to-all: the rows sent to others
    group_size: int
    phase: str  # forward | backward
    module: str
    launched: float
    modeled_end: Optional[float] = None  # under an emulated link
    completed: Optional[float] = None  # when the caller's wait() (or the blocking call) returned
    wait_started: Optional[float] = None  # when the caller started waiting (= launched for a blocking call)
    blocked_s: float = 0.0  # time the caller spent blocked on it
    events: Optional[List[Any]] = None  # CUDA link: [launch, end, wait] events (times resolved on exit)

    @property
    def exposed_ms(self) -> float:
        return 1e3 * self.blocked_s


class CommAccounting:
    """The records of every collective issued while active (see the module docstring)."""

    def __init__(self, model: Optional[nn.Module] = None) -> None:
        self.records: List[CommRecord] = []
        self._names = {id(m): n or type(m).__name__ for n, m in model.named_modules()} if model is not None else {}
        self._stack: List[str] = []
        self._hooks: List[Any] = []

    # -- context manager
    def __enter__(self) -> "CommAccounting":
        from torch.nn.modules import module as module_hooks

        self._hooks = [module_hooks.register_module_forward_pre_hook(self._push),
                       module_hooks.register_module_forward_hook(self._pop, always_call=True)]
        _activate(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _deactivate(self)
        for h in self._hooks:
            h.remove()
        self._stack.clear()
        self._resolve_device_times()

    def _resolve_device_times(self) -> None:
        """CUDA-link records: their times from the GPU's events, on the host clock of the first one."""
        timed = [r for r in self.records if r.events is not None and len(r.events) == 3]
        if not timed:
            return
        timed[0].events[1].synchronize()
        torch.cuda.synchronize()
        ref, base = timed[0].events[0], timed[0].launched
        for r in timed:
            launch, end, wait = (base + 1e-3 * ref.elapsed_time(e) for e in r.events)
            r.launched, r.completed, r.wait_started = launch, end, wait
            r.blocked_s = max(0.0, end - wait)

    def _push(self, module: nn.Module, args: Any) -> None:
        self._stack.append(self._names.get(id(module), type(module).__name__))

    def _pop(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._stack:
            self._stack.pop()

    def _where(self) -> Tuple[str, str]:
        node = torch._C._current_autograd_node()
        if node is not None:
            return "backward", node.name()
        return "forward", self._stack[-1] if self._stack else ""

    # -- summaries
    def counts(self) -> Dict[Tuple[str, str], int]:
        """{(op, phase): number of collectives}."""
        return dict(Counter((r.op, r.phase) for r in self.records))

    def total_bytes(self, op: Optional[str] = None, phase: Optional[str] = None) -> int:
        return sum(r.nbytes for r in self.records if (op is None or r.op == op) and (phase is None or r.phase == phase))

    def exposed_ms(self, phase: Optional[str] = None) -> float:
        """Milliseconds callers spent blocked on collectives (the part no compute hid)."""
        return sum(r.exposed_ms for r in self.records if phase is None or r.phase == phase)

    def summary(self) -> Dict[str, Any]:
        return {"collectives": len(self.records),
                "counts": {f"{op}/{phase}": n for (op, phase), n in sorted(self.counts().items())},
                "bytes": {f"{op}/{phase}": self.total_bytes(op, phase) for op, phase in sorted(self.counts())},
                "exposed_ms": {"forward": self.exposed_ms("forward"), "backward": self.exposed_ms("backward")}}

    def against(self, budget: CommBudget) -> BudgetComparison:
        """These records against ``budget`` (e.g. `tplayers.megatron_budget_for_hf`), per phase and
        collective: counts, bytes, bytes on the wire and measured / budget; ``print`` it for the table."""
        return BudgetComparison.of(self.records, budget)

    def __str__(self) -> str:
        rows = [f"{'op':<15} {'phase':<9} {'count':>5} {'MB':>10} {'exposed ms':>10}"]
        for (op, phase), n in sorted(self.counts().items()):
            mine = [r for r in self.records if r.op == op and r.phase == phase]
            rows.append(f"{op:<15} {phase:<9} {n:>5} {sum(r.nbytes for r in mine) / 1e6:>10.3f} "
                        f"{sum(r.exposed_ms for r in mine):>10.3f}")
        return "\n".join(rows)


def comm_accounting(model: Optional[nn.Module] = None) -> CommAccounting:
    """``with tplayers.comm_accounting(model) as acct: ...`` records every tplayers collective in
    ``acct.records`` (``model``: to name the issuing modules by their qualified names)."""
    return CommAccounting(model)


@dataclass
class EmulatedLink:
    """While active, tplayers' collectives complete no earlier than their modeled end (see module doc);
    with ``everywhere=True`` also the collectives other libraries issue through torch.distributed
    and its functional collectives (DTensor), by wrapping those functions for the duration."""

    link: LinkModel
    everywhere: bool = False
    _busy_until: Dict[int, float] = field(default_factory=dict)  # per process group: the link's queue
    _restore: Any = None
    _checks: Tuple[bool, float] = (True, 600.0)  # the collective checks' settings before entering
    _streams: Dict[Tuple[int, int], Any] = field(default_factory=dict)  # CUDA: (device, group) -> link stream

    def __enter__(self) -> "EmulatedLink":
        # The fingerprint exchange before each collective runs over the real backend, outside the
        # modeled link: it would count as compute in the emulated machine. Off while emulating.
        self._checks = set_collective_checks(False)
        _activate(self)
        if self.everywhere:
            self._restore = wrap_torch_distributed(self, inside=lambda: _OBSERVER.inside)
        return self

    def __exit__(self, *exc: Any) -> None:
        _deactivate(self)
        set_collective_checks(self._checks[0], timeout=self._checks[1])
        if self._restore is not None:
            self._restore()
            self._restore = None

    def modeled_end(self, op: str, nbytes: int, group: Any, group_size: int, launched: float) -> float:
        key = _group_key(group)
        start = max(launched, self._busy_until.get(key, 0.0))
        end = start + self.link.seconds(op, nbytes, group_size)
        self._busy_until[key] = end
        return end

    def on_device(self, op: str, nbytes: int, group: Any, group_size: int, device: torch.device) -> List[Any]:
        """The collective as a sleep of its modeled duration on this device's link stream, after the
        current stream's work so far; returns its [launch, end] events."""
        key = (device.index if device.index is not None else torch.cuda.current_device(), _group_key(group))
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device)
        launch, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        launch.record(torch.cuda.current_stream(device))
        stream.wait_event(launch)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(max(1, int(self.link.seconds(op, nbytes, group_size) * _cycles_per_second(device))))
        end.record(stream)
        return [launch, end]


def _group_key(group: Any) -> int:
    return id(group[0]) * 31 + group[1] if isinstance(group, tuple) else id(group)


_CYCLES: Dict[int, float] = {}


def _cycles_per_second(device: torch.device) -> float:
    """``torch.cuda._sleep`` cycles per second on ``device``, measured once (best of three)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CYCLES:
        cycles, best = 10_000_000, float("inf")
        for _ in range(3):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            stop.record()
            stop.synchronize()
            best = min(best, start.elapsed_time(stop) / 1e3)
        _CYCLES[index] = cycles / best
    return _CYCLES[index]


def emulated_link(spec: Union[str, LinkModel], *, everywhere: bool = False) -> EmulatedLink:
    """``with tplayers.emulated_link("h100-nvlink"): ...``: see :mod:`tplayers.bench.link` for specs.
    ``everywhere=True``: other libraries' collectives too (benchmarks/peers.py: DTensor,
    megatron-core, fairscale over the same wire)."""
    return EmulatedLink(parse_link(spec), everywhere)


# ---------------------------------------------------------------------------- core's observer hook


class _Observer:
    """Core's one observer while anything here is active: times each launch, records it for every
    active accounting and models it on every active link."""

    def __init__(self) -> None:
        self.inside = False  # a tplayers primitive is calling torch.distributed right now

    def launch(self, op: str, nbytes: int, g: TPGroup, device: Optional[torch.device], call: Any) -> Tuple[Any, Any]:
        t0 = time.perf_counter()
        self.inside = True  # torch.distributed may be wrapped too (emulated_link(everywhere=True)): not twice
        try:
            work = call()
        finally:
            self.inside = False
        record = launched(op, nbytes, g.process_group, g.size, t0, device)
        if work is None:  # a blocking call: its whole duration now, and the modeled rest slept out
            finished(record, t0)
        else:  # the caller was held in the launch itself too (a busy CPU backend: milliseconds)
            record.blocked_s += time.perf_counter() - t0
        return work, record

    def finished(self, token: CommRecord, wait_started: float) -> None:
        finished(token, wait_started)


_OBSERVER = _Observer()


def _activate(thing: Any) -> None:
    if not _ACTIVE:
        collectives.set_observer(_OBSERVER)
    _ACTIVE.append(thing)


def _deactivate(thing: Any) -> None:
    _ACTIVE.remove(thing)
    if not _ACTIVE:
        collectives.set_observer(None)


def launched(op: str, nbytes: int, group: Any, group_size: int, t0: float,
             device: Optional[torch.device] = None) -> CommRecord:
    """A collective was launched at ``t0``: its record, kept by every active accounting (the
    innermost one names its phase and module) and given its modeled end by every active link."""
    accountings = [a for a in _ACTIVE if isinstance(a, CommAccounting)]
    phase, module = accountings[-1]._where() if accountings else ("", "")
    record = CommRecord(op, nbytes, group_size, phase, module, t0)
    for active in _ACTIVE:
        if isinstance(active, EmulatedLink):
            if device is not None and device.type == "cuda":
                record.events = active.on_device(op, nbytes, group, group_size, device)
            else:
                record.modeled_end = active.modeled_end(op, nbytes, group, group_size, t0)
        else:
            active.records.append(record)
    return record


def finished(record: CommRecord, wait_started: float) -> None:
    """The caller's wait (or the blocking call, then ``wait_started`` = launch) returned: sleep out
    the rest of the modeled duration, then account the time blocked. CUDA link: the current stream
    waits for the link's end event instead (the host does not block)."""
    if record.events is not None:
        end = record.events[1]
        waiting = torch.cuda.current_stream()  # the waiter's stream, on the device it launched from
        wait = torch.cuda.Event(enable_timing=True)
        wait.record(waiting)
        waiting.wait_event(end)
        record.events.append(wait)
        record.completed, record.wait_started = time.perf_counter(), wait_started
        return
    if record.modeled_end is not None:
        sleep_until(record.modeled_end)
    record.completed = time.perf_counter()
    record.wait_started = wait_started
    record.blocked_s += record.completed - wait_started
