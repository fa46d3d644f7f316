"""2-D parallelism: a ``(dp, tp)`` DeviceMesh, its groups, and composition with DDP / FSDP2.

    mesh = tplayers.make_2d_mesh(dp=2, tp=2)                 # every rank of a 4-rank world
    tplayers.parallelize(model, plan, group=mesh.tp_group)   # or group=mesh.mesh (its "tp" dim)
    model = DDP(model, process_group=mesh.dp_group)          # or: fully_shard(model, mesh=mesh.dp_mesh)

Ranks are laid out TP-innermost (``rank = dp_index * tp + tp_index``), so a TP group is a run of
consecutive ranks (one node, fast links) and data-parallel replicas of one shard are ``tp`` apart.
TP parameters are plain tensors holding this rank's shard; DDP averages them over the dp group
and FSDP2 shards them further over it, both unaware of TP. Gradients of replicated parameters
(norms, biases of row layers) are already identical across a TP group, so no extra reduction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..core.groups import TPGroup, resolve_group

__all__ = ["Mesh2D", "make_2d_mesh"]


@dataclass(frozen=True)
class Mesh2D:
    """A ``(dp, tp)`` DeviceMesh with dims named ``"dp"`` and ``"tp"``, and its two groups."""

    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    dp_group: Any  # ProcessGroup of the ranks holding the same TP shard
    tp_group: Any  # ProcessGroup of the ranks sharing one model replica

    @property
    def dp_mesh(self) -> Any:
        return self.mesh["dp"]

    @property
    def tp_mesh(self) -> Any:
        return self.mesh["tp"]

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp_group)

    @property
    def tp(self) -> TPGroup:
        return resolve_group(self.tp_group)


def _default_device_type(backend: str, cuda_available: bool) -> str:
    """``"cuda"`` unless the world is gloo-only or there is no GPU: ``init_process_group()`` without a
    backend reports ``"undefined"`` (gloo for CPU, NCCL for CUDA), not ``"nccl"``."""
    return "cuda" if cuda_available and backend != "gloo" else "cpu"


def make_2d_mesh(dp: Optional[int] = None, tp: int = 1, *, device_type: Optional[str] = None) -> Mesh2D:
    """Build the ``(dp, tp)`` mesh over the whole (initialized) world; collective on every rank.

    ``dp`` defaults to ``world_size // tp``. ``device_type`` defaults to ``"cuda"`` when CUDA is
    available and the backend is not gloo alone (NCCL, or ``init_process_group()``'s default), else ``"cpu"``. Raises a clear error when ``dp * tp`` is not the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("make_2d_mesh needs torch.distributed initialized (init_process_group or torchrun)")
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise ValueError(f"make_2d_mesh: tp={tp} does not divide the world size {world}")
    dp = world // tp if dp is None else dp
    if dp * tp != world:
        raise ValueError(f"make_2d_mesh: dp={dp} x tp={tp} = {dp * tp} ranks, but the world has {world}")
    if device_type is None:
        device_type = _default_device_type(str(dist.get_backend()), torch.cuda.is_available())
    mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return Mesh2D(mesh, mesh.get_group("dp"), mesh.get_group("tp"))
