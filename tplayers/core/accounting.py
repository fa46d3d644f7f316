"""Comm accounting and link emulation: what every tplayers collective moved, and when.

`comm_accounting()` (like DTensor's ``CommDebugMode``) records each collective tplayers issues: op,
bytes (the full buffer, see :mod:`.link`), group size, phase (forward / backward), the issuing
module (forward: the innermost module running; backward: the autograd node) and how long the
caller was blocked in ``wait()`` (the exposed part of that collective, as the host saw it: on CUDA,
where ``wait()`` does not block the host, that is the stream-ordering time, not the GPU's).

`emulated_link(spec)` makes every collective complete, as ``wait()`` (or a blocking call) sees it,
no earlier than its modeled end: launch (or the end of the previous collective on the same group:
one link, collectives in order) + `LinkModel.seconds`, sleeping (no CPU) for the rest. The data
still moves over the real backend, so results stay exact. It covers the collectives tplayers
issues (core/collectives.py); other libraries' collectives (DTensor, megatron-core) are not slowed.

Both are context managers holding explicit objects; the primitives check one module-level list
(empty when nothing is active: the cost when off is one truth test per collective).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from .link import LinkModel, parse_link

__all__ = ["CommRecord", "CommAccounting", "comm_accounting", "EmulatedLink", "emulated_link"]

_ACTIVE: List[Any] = []  # the CommAccounting / EmulatedLink objects now active (innermost last)


@dataclass
class CommRecord:
    """One collective: what, where, and its times (``time.perf_counter`` seconds)."""

    op: str  # all_reduce | all_gather | reduce_scatter | broadcast
    nbytes: int  # the full buffer (all-gather output, reduce-scatter input)
    group_size: int
    phase: str  # forward | backward
    module: str
    launched: float
    modeled_end: Optional[float] = None  # under an emulated link
    completed: Optional[float] = None  # when the caller's wait() (or the blocking call) returned
    wait_started: Optional[float] = None  # when the caller started waiting (= launched for a blocking call)
    blocked_s: float = 0.0  # time the caller spent blocked on it

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
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        for h in self._hooks:
            h.remove()
        self._stack.clear()

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

    def __enter__(self) -> "EmulatedLink":
        _ACTIVE.append(self)
        if self.everywhere:
            from .collectives import wrap_torch_distributed  # (collectives imports this module)

            self._restore = wrap_torch_distributed(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        if self._restore is not None:
            self._restore()
            self._restore = None

    def modeled_end(self, op: str, nbytes: int, group: Any, group_size: int, launched: float) -> float:
        key = id(group[0]) * 31 + group[1] if isinstance(group, tuple) else id(group)
        start = max(launched, self._busy_until.get(key, 0.0))
        end = start + self.link.seconds(op, nbytes, group_size)
        self._busy_until[key] = end
        return end


def emulated_link(spec: Union[str, LinkModel], *, everywhere: bool = False) -> EmulatedLink:
    """``with tplayers.emulated_link("h100-nvlink"): ...``: see :mod:`tplayers.core.link` for specs.
    ``everywhere=True``: other libraries' collectives too (benchmarks/peers.py: DTensor,
    megatron-core, fairscale over the same wire)."""
    return EmulatedLink(parse_link(spec), everywhere)


# ---------------------------------------------------------------------------- hooks for the primitives


def launched(op: str, nbytes: int, group: Any, group_size: int, t0: float) -> CommRecord:
    """Called by a primitive right after launching a collective (only when something is active)."""
    accountings = [a for a in _ACTIVE if isinstance(a, CommAccounting)]
    phase, module = accountings[-1]._where() if accountings else ("", "")
    record = CommRecord(op, nbytes, group_size, phase, module, t0)
    for active in _ACTIVE:
        if isinstance(active, EmulatedLink):
            record.modeled_end = active.modeled_end(op, nbytes, group, group_size, t0)
        else:
            active.records.append(record)
    return record


def finished(record: CommRecord, wait_started: float) -> None:
    """Called when the caller's wait (or the blocking call, then ``wait_started`` = launch) returns:
    sleep out the rest of the modeled duration, then account the time blocked."""
    if record.modeled_end is not None:
        left = record.modeled_end - time.perf_counter()
        if left > 0:
            time.sleep(left)
    record.completed = time.perf_counter()
    record.wait_started = wait_started
    record.blocked_s += record.completed - wait_started


def active() -> bool:
    return bool(_ACTIVE)
