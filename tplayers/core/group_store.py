"""The key-value store torch keeps for a process group (its rendezvous's; a subgroup's prefixed with its name), and
what tplayers leaves there: the note of a rank waiting at a store barrier (:mod:`.store_barrier`), read by the error
of a rank whose own collective failed meanwhile (:func:`~.fingerprint.bounded_wait`)."""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from .groups import is_fake

__all__ = ["group_store", "store_prefix", "waiting_note"]


def group_store(pg: Any) -> Optional[Any]:
    """The store of ``pg`` (a subgroup's is prefixed with its name), or None where torch keeps none for it."""
    entry = getattr(dist.distributed_c10d, "_world", None)
    entry = None if entry is None else entry.pg_map.get(pg if pg is not None else dist.group.WORLD)
    return None if entry is None else entry[1]


def store_prefix(pg: Any) -> str:
    """Where tplayers keeps its keys for ``pg`` in the store."""
    pg = pg if pg is not None else dist.group.WORLD
    return f"tplayers/store_barrier/{getattr(pg, 'group_name', None) or dist.distributed_c10d._world.pg_names.get(pg)}"


def waiting_note(pg: Any) -> str:
    """What a rank of ``pg`` that waited at a store barrier left in the store ('' if none): for the error of a rank
    whose own collective failed meanwhile."""
    store = group_store(pg)
    if store is None or is_fake(pg):
        return ""
    key = f"{store_prefix(pg)}/waiting"
    try:
        return store.get(key).decode() if store.check([key]) else ""
    except RuntimeError:
        return ""
