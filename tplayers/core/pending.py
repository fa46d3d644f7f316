"""A collective in flight (`Pending`) and the one hook every launch passes through (`Observer`).

Core knows nothing of benchmarks: every primitive of :mod:`.collectives` runs its ``torch.distributed`` call
through :func:`launch`, where one `Observer` (installed by ``tplayers.comm_accounting`` /
``tplayers.emulated_link``, on the bench floor) may watch it; with none installed that costs one truth test.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Protocol, Tuple

import torch

from .groups import TPGroup

if TYPE_CHECKING:
    from .fingerprint import Stamp

__all__ = ["Pending", "Observer", "set_observer", "launch", "TRACE_COLLECTIVES", "eager_on_old_torch"]

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


def launch(op: str, nbytes: int, g: TPGroup, call: Callable[[], Any],
            device: Optional[torch.device] = None) -> Tuple[Any, Any]:
    """Run the ``dist`` call, through the observer when one is installed: ``(work, observed)``."""
    observer = _OBSERVER[0]
    if observer is None:
        return call(), None
    work, token = observer.launch(op, nbytes, g, device, call)
    return work, (observer, token)
