"""Coordinating the ranks that write one checkpoint: the group, a shared temporary name, work done on
rank 0 only with its failure raised on every rank (no rank left waiting), and durable writes."""
from __future__ import annotations

import contextlib
import json
import os
import uuid
import warnings
from typing import Any, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from ..core.collectives import wait_for_ranks
from ..core.blocking import broadcast_tensor, bytes_hash, ranks_that_differ
from ..core.groups import collective_device
from .walk import CheckpointError

__all__ = ["dcp_errors", "quiet", "coord_group", "require_same_path", "agree_token", "on_rank0", "fsync_dir", "write_json"]


@contextlib.contextmanager
def dcp_errors(caller: str, path: str) -> Iterator[None]:
    """Re-raise DCP's ``CheckpointException`` (a BaseException: ``except Exception`` would miss it)
    as a :class:`CheckpointError` naming the call and the path."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception:
        raise
    except BaseException as e:  # noqa: BLE001
        raise CheckpointError(_stopped_short(caller, e) + f"{caller}: torch.distributed.checkpoint failed for "
                              f"{path}: {type(e).__name__}: {e}") from e


# How a write that stopped short reads in DCP's failures: torch.save's zip writer ("unexpected pos"), the OS.
_SHORT_WRITES = ("unexpected pos", "File too large", "No space left on device", "Disk quota exceeded")


def _stopped_short(caller: str, e: BaseException) -> str:
    """The lead of a save's error when a rank's write stopped short (a full disk, a file-size limit): which
    ranks, the likely causes, and on such a rank its own file-size limit; "" for any other failure. (DCP raises
    the same exception on every rank, carrying every failed rank's.)"""
    if not any(mark in str(e) for mark in _SHORT_WRITES):
        return ""
    failed = sorted(getattr(e, "failures", None) or [])
    limit = ""
    if dist.is_initialized() and dist.get_rank() in failed:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft != resource.RLIM_INFINITY:
            limit = f" This rank's file-size limit (ulimit -f) is {soft} bytes."
    return (f"{caller}: rank(s) {failed or '?'} could not write their part of the checkpoint: a write stopped short "
            f"(a full disk, a disk quota, or a file-size limit, ulimit -f, on that node); nothing was published and "
            f"the checkpoint that was there is kept.{limit}\n")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """DCP warns that it runs single-process when torch.distributed is not initialized: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def coord_group(group: Any, caller: str, timeout: Optional[float] = None) -> Tuple[Any, int]:
    """(the process group of every rank taking part in a collective save/load, this rank in it);
    (None, 0) without torch.distributed. ``group=None`` is the whole world. ``timeout`` (a collective
    call): every rank must arrive within that many seconds, or an error names the ranks missing."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 0
    if group is None:
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        mesh_dims = getattr(group, "ndim", None)
        if mesh_dims != 1:
            raise TypeError(f"{caller}: group must be None (every rank of the world), a ProcessGroup or a 1-D "
                            f"DeviceMesh of every rank that takes part, got {type(group).__name__}"
                            + (f" with {mesh_dims} dims (pass None for the whole mesh)" if mesh_dims else ""))
        group = group.get_group()
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{caller}: this process (global rank {dist.get_rank()}) is not a member of the group")
    if timeout is not None:
        wait_for_ranks(group, timeout, caller)
    return group, rank


def require_same_path(pg: Any, path: str, caller: str, content: Optional[bytes] = None) -> None:
    """Refuse, on every rank, a collective save/load given different paths on different ranks (a
    checkpoint missing some ranks' shards, or a model loaded from two checkpoints); with ``content``
    (a load: the checkpoint's manifest as this rank reads it), also the same path showing different
    checkpoints (node-local directories). One all-gather of the hashes."""
    if pg is None:
        return
    blobs = [os.fsencode(path)] + ([content] if content is not None else [])
    hashes = torch.stack([bytes_hash(b) for b in blobs])
    differ = ranks_that_differ(hashes, group=pg)  # (p, 1 or 2): the path, the content
    if not differ.any():
        return
    if differ[:, 0].any():
        ranks = differ[:, 0].nonzero().flatten().tolist()
        raise CheckpointError(f"{caller}: rank(s) {ranks} passed a different path than rank 0 (this rank: {path}); "
                              "every rank must pass the same path (on a shared file system for a multi-node save)")
    ranks = differ[:, 1].nonzero().flatten().tolist()
    raise CheckpointError(f"{caller}: rank(s) {ranks} see a different checkpoint at {path} than rank 0 (its manifest "
                          "differs or is missing: node-local directories, or a copy from another save); every rank "
                          "must read the same checkpoint (a shared file system)")


def agree_token(pg: Any, rank: int) -> str:
    """A random token drawn on rank 0 and broadcast (all ranks name the same temporary dir)."""
    token = torch.tensor([uuid.uuid4().int % (2**62) if rank == 0 else 0], dtype=torch.int64)
    if pg is not None:
        token = broadcast_tensor(token.to(collective_device(pg)), 0, group=pg).cpu()
    return f"{int(token.item()):016x}"


def on_rank0(pg: Any, rank: int, fn: Any) -> None:
    """Run ``fn`` on rank 0 only, then make every rank raise if it failed (no rank left waiting).

    Rank 0 re-raises its own exception; the others raise :class:`CheckpointError` carrying its
    message (broadcast as bytes), so an error on rank 0 alone never hangs the rest in a collective.
    """
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (re-raised below, after the others heard of it)
            error = e
    if pg is None:
        if error is not None:
            raise error
        return
    msg = torch.zeros(1024, dtype=torch.uint8)
    if error is not None:
        text = f"{type(error).__name__}: {error}".encode()[:1023] or b"?"
        msg[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    msg = broadcast_tensor(msg.to(collective_device(pg)), 0, group=pg).cpu()
    if error is not None:
        raise error
    if msg[0]:
        text = bytes(msg[msg.nonzero().flatten()].tolist()).decode(errors="replace")
        raise CheckpointError(f"rank 0 failed to finish the save: {text}")


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
