"""Every rank of a group at one point before a collective whose partner a rank may never issue, agreed through the
process group's store instead of a collective.

A collective cannot check that every rank issued it when a rank that did not issues another of a different size:
gloo pairs the two buffers and aborts the process ("Received data size doesn't match"; NCCL may hang), before any
fingerprint is compared (:mod:`.fingerprint`). The store (the rendezvous's TCP key-value store) pairs nothing: each
rank sets its own key and waits, at most the checks' timeout, for every rank's. Used where a rank alone plausibly
calls a collective: a read of an embedding's :class:`~tplayers.regions.partial_sum.PartialSum` outside the model's
forward (a log on rank 0). The ranks that never came are named on the rank that waited; the others, waiting at their
own next collective, find the note it left (:func:`.group_store.waiting_note`) and name it too. One store round trip
per rank and call (tens of microseconds on a node); nothing on a fake group.
"""
from __future__ import annotations

import time
from typing import Any, Dict

from .fingerprint import CollectivesOutOfStep
from .group_store import group_store, store_prefix
from .groups import TPGroup, is_fake

__all__ = ["store_barrier"]

_CALLS: Dict[str, int] = {}  # group name -> store barriers so far (the same count on every rank that takes part)


def store_barrier(g: TPGroup, what: str, timeout: float, advice: str) -> None:
    """Wait until every rank of ``g`` has come to ``what`` (an infinitive: "read the output of ..."), at most ``timeout``
    seconds; then raise :class:`~.fingerprint.CollectivesOutOfStep` naming the ranks that did not come, and ``advice``."""
    pg, store = g.process_group, group_store(g.process_group)
    if g.size == 1 or store is None or is_fake(pg):
        return
    name = store_prefix(pg)
    n = _CALLS.get(name, 0)
    _CALLS[name] = n + 1
    keys, gave_up = [f"{name}/{n}/{r}" for r in range(g.size)], f"{name}/{n}/gave_up"
    store.set(keys[g.rank], "1")
    started, pause, noted = time.monotonic(), 0.001, False
    while True:
        if store.check([gave_up]):  # a rank that came earlier waited its timeout out: nobody waits for this one
            raise CollectivesOutOfStep(f"tplayers: rank {g.rank} came to {what}, but {store.get(gave_up).decode()} "
                                       f"had stopped waiting for it (the other ranks were not there). {advice}")
        if store.check(keys):
            break
        waited = time.monotonic() - started
        if waited > timeout:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            store.set(gave_up, f"rank {g.rank}")
            _delete(store, keys[g.rank])  # (a rank coming later must not pass: nobody would pair its collective)
            raise CollectivesOutOfStep(
                f"tplayers: rank {g.rank} waited {timeout:g} s for every rank of the TP group to {what}; rank(s) "
                f"{missing} did not come (they went on to other collectives, which would pair with this one: gloo "
                f"aborts on the size, NCCL may hang). {advice}")
        if waited > 0.5 and not noted:  # (for the errors of the ranks waiting at their own collectives meanwhile)
            store.set(f"{name}/waiting", f"rank {g.rank} of the TP group is waiting for every rank to {what}")
            noted = True
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    if noted:
        _delete(store, f"{name}/waiting")
    if n:
        _delete(store, f"{name}/{n - 1}/{g.rank}")  # (every rank has passed the one before: read no more)


def _delete(store: Any, key: str) -> None:
    try:
        store.delete_key(key)
    except (RuntimeError, NotImplementedError):  # (a store that cannot delete keeps it: a few bytes)
        pass
