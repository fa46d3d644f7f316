"""A shard labelled as one: a placement's local tensor as a ``DTensor`` over the TP group, and back.

PyTorch's own representation of a shard is a ``DTensor``: its global shape is the dense tensor's and
its placement says which rows this rank holds, so ``torch.distributed.checkpoint`` (DCP) writes each
shard once and reshards it on load, and nothing outside tplayers can take it for the whole tensor.
Every state view a TP model hands out (``state_dict()``, its optimizer's ``state_dict()``, DCP's
``get_model_state_dict`` / ``get_optimizer_state_dict``) labels its shards here.

Under FSDP2 (TP x FSDP2 on a ``(dp, tp)`` mesh) a TP shard is itself a DTensor over the dp ranks, its
global tensor this rank's TP shard; :func:`as_dtensor_over_dp_tp` labels it over the 2-D mesh instead (the
dense shape, placements ``(dp: _StridedShard(0, tp) or Shard(0), tp: Shard(dim))``, as torch's own TP x
FSDP2 does), and :func:`from_dtensor_over_dp_tp` reads it back.

A DTensor ``Shard(dim)`` over ``p`` ranks holds ``torch.chunk`` pieces: rank ``r`` rows
``[r * c, min((r + 1) * c, n))`` with ``c = ceil(n / p)``. A :class:`~tplayers.core.placement.Sharded`
placement says that exactly when it has one part, cut into ``p`` pieces (no replicas) of torch.chunk's
sizes (a padded vocabulary is: its padding rows are simply left out of the DTensor). What it cannot say
(fused q/k/v parts, pieces held by several ranks, uneven head counts) :func:`unlabelled_reason`
explains, and the callers refuse rather than hand the shard out as the whole tensor.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .groups import TPGroup
from .placement import Placement

__all__ = ["UnlabelledShard", "is_dtensor", "unlabelled_reason", "shard_dtensor", "as_dtensor", "local_rows",
           "as_dtensor_over_dp_tp", "from_dtensor_over_dp_tp"]

class UnlabelledShard(ValueError):
    """A shard that no DTensor over the TP group describes was asked for as a state view (the message names
    the parameter, why, and the tplayers route that handles it)."""


_MESHES: Dict[Tuple[int, str], Tuple[Any, Any]] = {}  # (id(process group), device type) -> (group, its 1-D mesh)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it eagerly)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh")


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _dtensor_mesh(group: TPGroup, device: torch.device) -> Any:
    """The 1-D ``DeviceMesh`` over ``group``'s ranks (made once per process group and device type;
    ``DeviceMesh.from_group`` runs no collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    pg = group.process_group
    key = (id(pg), device.type)
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not pg:  # a destroyed group's id may be reused
        cached = (pg, DeviceMesh.from_group(pg, device_type=device.type))
        _MESHES[key] = cached
    return cached[1]


def _chunk_lengths(size: int, p: int) -> List[int]:
    c = -(-size // p)
    return [max(0, min(c, size - r * c)) for r in range(p)]


def unlabelled_reason(placement: Placement, size: int) -> Optional[str]:
    """None when a DTensor ``Shard(dim)`` over ``size`` ranks describes ``placement``'s local tensors;
    else why not, in words (for an error naming the parameter)."""
    if not placement.is_sharded or size == 1:
        return None
    parts = placement.parts  # type: ignore[attr-defined]
    if len(parts) > 1:
        return (f"its dim {placement.dim} fuses {len(parts)} components (q/k/v or gate/up), each split on "
                "its own, which no DTensor placement over the TP group describes")
    part = parts[0]
    if part.shards != size or part.holders is not None:
        return (f"its {part.shards} pieces are held by several ranks each (KV heads fewer than the TP degree "
                f"{size}), which no DTensor placement over the TP group describes")
    lengths = [part.piece(j)[1] for j in range(size)]
    if lengths != _chunk_lengths(part.size, size):
        return (f"its pieces have {lengths} rows (heads or ffn that do not divide the TP degree), where a DTensor "
                f"over {size} ranks holds torch.chunk's {_chunk_lengths(part.size, size)}")
    return None


def shard_dtensor(rows: torch.Tensor, group: TPGroup, dim: int, shape: Tuple[int, ...]) -> Any:
    """``rows`` as this rank's ``Shard(dim)`` piece of a DTensor of ``shape`` over ``group`` (no copy, no collective)."""
    from torch.distributed.tensor import DTensor, Shard

    shape = tuple(shape)
    return DTensor.from_local(rows, _dtensor_mesh(group, rows.device), [Shard(dim)], run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def as_dtensor(local: torch.Tensor, placement: Placement, group: TPGroup) -> Any:
    """``local`` (this rank's local tensor of ``placement``, padding rows included) as a DTensor of the
    dense tensor's shape, ``Shard(dim)`` over ``group``: a view, no copy and no collective. The caller
    checked :func:`unlabelled_reason`."""
    d = placement.dim
    assert d is not None
    piece = placement.pieces(group.rank, group.size)[0]
    return shard_dtensor(local.narrow(d, piece.local_start, piece.length), group, d, placement.full_shape(local.shape))


def local_rows(value: Any, placement: Placement, group: TPGroup, local: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's local tensor of ``placement`` (``local``'s shape, padding rows zero) from ``value``:
    a DTensor labelled as :func:`as_dtensor` labels it, the dense tensor (cut here), or ``local``'s own
    shape (this rank's shard, as plain state dicts of older tplayers held it: returned as it is).
    Anything else raises a ValueError naming ``what``."""
    full = tuple(placement.full_shape(local.shape))
    if is_dtensor(value):
        from torch.distributed.tensor import Shard

        mesh = value.device_mesh
        ranks, mine = mesh.mesh.flatten().tolist(), group.global_ranks()
        if tuple(value.shape) != full or mesh.ndim != 1 or ranks != mine or \
                tuple(value.placements) != (Shard(placement.dim),):
            raise ValueError(f"{what}: a DTensor of shape {tuple(value.shape)} placed {tuple(value.placements)} over "
                             f"ranks {ranks}; this rank's TP shard is of the dense shape {full}, Shard({placement.dim}) "
                             f"over the TP group's ranks {mine}. Load it through torch.distributed.checkpoint (which "
                             "reshards) or tplayers.load_checkpoint")
        value = value.to_local()
        piece = placement.pieces(group.rank, group.size)[0]
        out = local.new_zeros(local.shape)
        out.narrow(placement.dim, piece.local_start, piece.length).copy_(value)
        return out
    if not isinstance(value, torch.Tensor):
        return value
    if tuple(value.shape) == full and full != tuple(local.shape):
        return placement.shard(value.to(local.device), group.rank, group.size)
    return value


def _dp_tp_spec(value: Any, placement: Placement, group: TPGroup) -> Tuple[Optional[Tuple[Any, tuple]], str]:
    """((the (dp, tp) root mesh, the placements on it), "") for ``value``, FSDP2's DTensor over dp of a TP shard of
    ``placement``; or (None, why not)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    reason = unlabelled_reason(placement, group.size)
    if reason is not None:
        return None, reason
    mesh, p, d = value.device_mesh, group.size, placement.dim
    if mesh.ndim != 1 or tuple(value.placements) != (Shard(0),):
        return None, f"FSDP2 placed it {tuple(value.placements)} over a {mesh.ndim}-D mesh (tplayers labels Shard(0) on 1)"
    root = mesh._get_root_mesh()
    names = tuple(root.mesh_dim_names or ())
    dp_name = (mesh.mesh_dim_names or (None,))[0]
    if root.ndim < 2 or dp_name not in names or names.index(dp_name) != root.ndim - 2:
        return None, ("its data-parallel mesh is not the dim just outside the TP dim of a (dp, tp) mesh "
                      "(tplayers.make_2d_mesh) or a (pp, dp, tp) one")
    tp_mesh = root[names[-1]]
    if root.ndim > 2:  # a (pp, dp, tp) mesh: labelled over this stage's (dp, tp) sub-mesh (the stages hold other names)
        root = root[names[-2], names[-1]]
    if tp_mesh.mesh.flatten().tolist() != group.global_ranks():
        return None, "the inner dim of its 2-D mesh is not this layer's TP group"
    part = placement.parts[0]  # type: ignore[attr-defined]
    if part.size % p or value.shape[0] % mesh.size():
        return None, (f"its TP shard has padding rows or {value.shape[0]} rows that the {mesh.size()} dp ranks do not "
                      "divide, which no DTensor over the (dp, tp) mesh describes")
    dp_placement = _StridedShard(0, split_factor=p) if d == 0 else Shard(0)
    return (root, (dp_placement, Shard(d))), ""


def as_dtensor_over_dp_tp(value: Any, placement: Placement, group: TPGroup, what: str) -> Any:
    """FSDP2's DTensor over dp of a TP shard (of ``placement``) as a DTensor of the dense shape over the (dp, tp)
    mesh: its local tensor as it is (a view; no collective). Raises :class:`UnlabelledShard` naming ``what``."""
    from torch.distributed.tensor import DTensor

    spec, reason = _dp_tp_spec(value, placement, group)
    if spec is None:
        raise UnlabelledShard(f"{what}: this TP shard is sharded again by FSDP2 and {reason}; state views refuse to hand "
                              "it out as the whole tensor. Save TP x FSDP2 models with tplayers.save_checkpoint(model, "
                              "path, optimizer=...) (any dp and TP size)")
    root, placements = spec
    shape = tuple(placement.full_shape(value.shape))
    return DTensor.from_local(value.to_local(), root, placements, run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


def from_dtensor_over_dp_tp(value: Any, like: Any, placement: Placement, group: TPGroup, what: str) -> Any:
    """``value``, a DTensor :func:`as_dtensor_over_dp_tp` would make for ``like`` (FSDP2's DTensor of this rank's TP
    shard), as a DTensor of ``like``'s spec (its local tensor as it is); a ValueError naming ``what`` otherwise."""
    from torch.distributed.tensor import DTensor

    spec, reason = _dp_tp_spec(like, placement, group)
    want = tuple(placement.full_shape(like.shape))
    if spec is None or not is_dtensor(value) or value.device_mesh != spec[0] or \
            tuple(value.placements) != spec[1] or tuple(value.shape) != want:
        got = (f"a DTensor of shape {tuple(value.shape)} placed {tuple(value.placements)} over {value.device_mesh}"
               if is_dtensor(value) else f"a {type(value).__name__}")
        raise ValueError(f"{what}: got {got}; this TP x FSDP2 shard takes the DTensor its state_dict() gives (the "
                         f"dense shape {want} over the (dp, tp) mesh{'' if spec is None else f', {spec[1]}'}). Load it "
                         "through torch.distributed.checkpoint (which reshards) or tplayers.load_checkpoint")
    return DTensor.from_local(value.to_local(), like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())
