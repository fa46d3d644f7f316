"""Which ranks share a layer: a ProcessGroup or DeviceMesh resolved to (group, rank, size).

A `TPGroup` is the only group object the rest of the library handles. It is built once per
module from what the user passed (`group=`), so every layer knows its rank and TP degree
without consulting global state.

``group=None`` is an explicit "no tensor parallelism": a world of one that needs no process
group at all (useful for TP=1 runs and single-process tests).

A TP group must not share two ranks with the process group of a DistributedDataParallel around the
model (:func:`refuse_replicating_wrapper`, which the linears call inside DDP's forward).
"""
from __future__ import annotations

import atexit
import gc
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .placement import holder_slot

__all__ = ["TPGroup", "GroupLike", "resolve_group", "collective_device", "replica_slot", "replica_group",
           "refuse_replicating_wrapper"]


@dataclass(frozen=True)
class TPGroup:
    """A resolved tensor-parallel group: the process group (None for a world of one),
    this process's rank in it and its size."""

    process_group: Optional[Any]
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not (0 <= self.rank < self.size):
            raise ValueError(f"invalid TP group: rank {self.rank} of size {self.size}")
        if self.size > 1 and self.process_group is None:
            raise ValueError("a TP group larger than one needs a process group")

    # Modules holding a TPGroup are deep-copied (EMA copies, torch.compile, FSDP); the process
    # group inside must stay the same object, never a copy.
    def __deepcopy__(self, memo: dict) -> "TPGroup":
        return self

    def __copy__(self) -> "TPGroup":
        return self

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"

    def global_ranks(self) -> List[int]:
        """The global ranks of this group's members, in group order (a world of one: this process's rank)."""
        if self.process_group is None:
            return [dist.get_rank()] if dist.is_available() and dist.is_initialized() else [0]
        return dist.get_process_group_ranks(self.process_group)

    def peers_among(self, ranks: Iterable[int]) -> List[int]:
        """The members of this group among the global ``ranks`` (two or more: a wrapper over those ranks, DDP or
        FSDP2, treats TP peers' different shards as one tensor)."""
        return sorted(set(ranks) & set(self.global_ranks()))

    def shard(self, full: torch.Tensor, dim: int, *, what: str = "tensor") -> torch.Tensor:
        """This rank's chunk of ``full`` along ``dim`` (``torch.chunk`` order; a view)."""
        if full.shape[dim] % self.size != 0:
            raise ValueError(
                f"{what}: size {full.shape[dim]} along dim {dim} is not divisible by the TP degree {self.size}"
            )
        return full.chunk(self.size, dim=dim)[self.rank]


GroupLike = Union[None, "TPGroup", "dist.ProcessGroup", "torch.distributed.device_mesh.DeviceMesh"]

_SINGLE = TPGroup(None, 0, 1)


def _is_device_mesh(obj: Any) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(obj, DeviceMesh)


def _from_mesh(mesh: Any) -> TPGroup:
    if mesh.get_coordinate() is None:  # else torch fails deep inside get_group with an IndexError
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not part of the DeviceMesh it was given "
            f"(ranks {mesh.mesh.flatten().tolist()}); every rank must pass a mesh it belongs to")
    names = mesh.mesh_dim_names
    if mesh.ndim == 1:
        pg = mesh.get_group()
    elif names is not None and "tp" in names:
        pg = mesh.get_group("tp")
    else:
        raise ValueError(
            f"a {mesh.ndim}-D DeviceMesh with dims {names} was passed as the TP group: pass a 1-D "
            "mesh, a mesh with a dimension named 'tp', or mesh['tp']"
        )
    return _from_process_group(pg)


def _from_process_group(pg: Any) -> TPGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "a ProcessGroup was passed but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group(...) first, or pass group=None for a world of one"
        )
    rank = dist.get_rank(pg)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the TP group it was "
            "given; every rank must pass the group it belongs to"
        )
    _release_groups_at_exit()
    return TPGroup(pg, rank, dist.get_world_size(pg))


_EXIT_HOOK = False


def _release_groups_at_exit() -> None:
    """Register (once) `_destroy_gloo_groups` to run at interpreter exit."""
    global _EXIT_HOOK
    if not _EXIT_HOOK:
        _EXIT_HOOK = True
        atexit.register(_destroy_gloo_groups)


def _destroy_gloo_groups() -> None:
    """atexit: destroy a gloo world the script left alive, collect garbage, and give gloo's worker
    threads a moment to let go of their last collectives.

    Why: ProcessGroupGloo's worker threads stop only when the C++ process group is destroyed, and
    a worker drops its reference to the last finished collective a moment after ``wait()``
    returns. When that happens during interpreter finalization (the group still referenced by
    torch.distributed's tables, by a module-level model, or by a reference cycle only the
    finalizing gc frees), releasing the collective's tensors needs the GIL, the finalizing
    interpreter ends the worker thread instead, and the process aborts ("terminate called without
    an active exception", exit 134; core dump: ``~AsyncAllgatherWork -> decref_pyobject ->
    take_gil -> pthread_exit``). Here, while the interpreter is whole: a gloo default group still
    alive is destroyed (its workers joined once nothing else holds it; destroying NCCL
    communicators at exit can block on peers, so those are left alone), cycles are collected,
    and a 0.1 s sleep (the GIL released) lets a worker still holding a finished collective release
    it. A group kept alive by a module-level object past this point can still, very rarely, hit
    the race: keep models inside a function (``main()``) and call ``destroy_process_group``.
    """
    try:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            # the user's group, not tplayers': say so instead of owning that silently
            warnings.warn("tplayers: the default gloo process group is still alive at exit; tplayers destroys it now "
                          "(a gloo group destroyed during interpreter shutdown can abort the process, exit 134). "
                          "Call torch.distributed.destroy_process_group() before your script ends.", stacklevel=1)
            dist.destroy_process_group()
    finally:
        gc.collect()
        time.sleep(_EXIT_GRACE_S)


_EXIT_GRACE_S = 0.1


def resolve_group(group: GroupLike) -> TPGroup:
    """Turn what a user passes as ``group`` into a :class:`TPGroup`.

    Accepts ``None`` (a world of one, no process group needed), a ``ProcessGroup``, a 1-D
    ``DeviceMesh`` or a ``DeviceMesh`` with a dimension named ``"tp"``, or a ``TPGroup``.
    """
    if group is None:
        return _SINGLE
    if isinstance(group, TPGroup):  # first: the per-call path of every layer (and traceable by dynamo)
        return group
    if dist.is_available() and group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()):
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the TP group it was "
            "given (new_group returned NON_GROUP_MEMBER); every rank must pass the group it belongs to"
        )
    if _is_device_mesh(group):
        return _from_mesh(group)
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return _from_process_group(group)
    raise TypeError(
        f"group must be a torch.distributed ProcessGroup, a DeviceMesh, a TPGroup or None, "
        f"got {type(group).__name__}"
    )


def is_fake(process_group: Any) -> bool:
    """A ``fake`` backend group (``tplayers bench --simulate``): its collectives return at once and
    move nothing, so there are no peers to compare with or gather from."""
    return process_group is not None and dist.get_backend(process_group) == "fake"


def collective_device(process_group: Any) -> torch.device:
    """Where small coordination tensors for ``process_group`` must live: a group whose backend is
    NCCL only has no CPU path, so its tensors go to the current CUDA device; else the CPU."""
    if process_group is not None and dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


_WRAPPERS_SEEN: Dict[Tuple[int, int], Tuple[Any, Any]] = {}  # (DDP, TP process group) pairs found fine


def refuse_replicating_wrapper(op: str, g: TPGroup) -> None:
    """A RuntimeError naming the fix when this forward runs inside a ``DistributedDataParallel`` whose process
    group holds two or more ranks of ``g``: DDP's constructor broadcast one rank's parameters to the others,
    so TP peers now hold another rank's shards, and its gradient all-reduce would average different shards.
    Raised on every rank (each runs the same forward), before any backward or step. Local: no collective."""
    if g.size == 1 or torch.compiler.is_compiling():  # (DDP's forward, which sets it, runs outside the graph)
        return
    active = DistributedDataParallel._active_ddp_module
    if active is None:
        return
    key = (id(active), id(g.process_group))
    seen = _WRAPPERS_SEEN.get(key)
    if seen is not None and seen[0]() is active and seen[1] is g.process_group:
        return
    wrapper = dist.get_process_group_ranks(active.process_group)
    shared = g.peers_among(wrapper)
    if len(shared) < 2:
        _WRAPPERS_SEEN[key] = (weakref.ref(active), g.process_group)
        return
    raise RuntimeError(
        f"{op}: the model runs inside DistributedDataParallel over ranks {sorted(wrapper)}, which include TP peers "
        f"{shared} (this layer's TP group: ranks {g.global_ranks()}). DDP's constructor copied rank {min(wrapper)}'s parameters to "
        "every rank of its group, so these TP ranks now hold another rank's shards, and its gradient all-reduce would "
        "average different shards. Wrap DDP over the data-parallel ranks only: mesh = tplayers.make_2d_mesh(dp=..., "
        "tp=...); parallelize(model, plan, group=mesh.mesh); DDP(model, process_group=mesh.dp_group) (docs/models.md, "
        "'2-D parallelism'). transformers.Trainer and accelerate wrap DDP over the whole world: they cannot train a "
        "tplayers model (docs/models.md, 'Checkpoints and resuming at scale')")
