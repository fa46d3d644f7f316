"""The model as the io floor sees it: every persistent tensor with its placement, TP group, tied
aliases and whether its dense form is transposed (GPT-2 ``Conv1D``); and the dense state dict.

A tensor that a wrapper has made a DTensor (FSDP2 sharding a TP shard again over the data-parallel
ranks) is read through :func:`tp_local` (its global tensor: this rank's TP-local tensor, gathered
over the wrapper's mesh) and written through :func:`writable` (a plain buffer of that shape whose
rows go back into the wrapper's local piece), so a checkpoint of a TP x FSDP2 model holds exactly
what one of the TP model holds, and loads at any dp and TP size."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ..core.blocking import gather_placed
from ..core.dtensors import is_dtensor
from ..core.groups import TPGroup
from ..core.placement import Part, Piece, Sharded
from ..layers.base import TensorParallelModule, placements_of

__all__ = ["CheckpointError", "Entry", "entries", "refuse_meta", "parts_of", "tp_local", "writable",
           "dense_state_dict"]


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not fit the model (the message names what)."""


@dataclass
class Entry:
    """One state-dict tensor of the model: where it lives and how it maps to the full tensor."""

    name: str
    tensor: torch.Tensor  # the local tensor (the parameter/buffer itself)
    layout: Optional[Sharded]  # None: replicated
    group: Optional[TPGroup]
    transposed: bool  # dense form stores the transpose (GPT-2 Conv1D weight)
    aliases: Tuple[str, ...] = ()  # other names of the same (tied) tensor

    def full_shape(self) -> Tuple[int, ...]:
        return self.layout.full_shape(self.tensor.shape) if self.layout is not None else tuple(self.tensor.shape)


def entries(model: nn.Module) -> List[Entry]:
    """Every persistent parameter and buffer of ``model``, tied tensors once (first name wins)."""
    out: List[Entry] = []
    seen: Dict[int, Entry] = {}
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        layouts = placements_of(mod)
        tensors = [(n, t) for n, t in mod._parameters.items() if t is not None]
        tensors += [(n, t) for n, t in mod._buffers.items()
                    if t is not None and n not in mod._non_persistent_buffers_set]
        for pname, t in tensors:
            name = prefix + pname
            tp = mod.group if isinstance(mod, TensorParallelModule) else None
            if is_dtensor(t):
                _refuse_wrapper_over_tp_peers(name, t, tp)
            if id(t) in seen:
                seen[id(t)].aliases += (name,)
                continue
            layout = layouts.get(pname)
            if layout is not None and not layout.is_sharded:
                layout = None
            e = Entry(name, t, layout, tp, bool(getattr(mod, "dense_transposed", False)) and pname == "weight")
            seen[id(t)] = e
            out.append(e)
    return out


def _refuse_wrapper_over_tp_peers(name: str, t: torch.Tensor, tp: Optional[TPGroup]) -> None:
    """A DTensor wrapper (FSDP2) over ranks that include TP peers holds different shards as one tensor."""
    if tp is None or tp.size == 1:
        return
    wrapper = t.device_mesh.mesh.flatten().tolist()
    peers = tp.peers_among(wrapper)
    if len(peers) > 1:
        raise CheckpointError(f"'{name}' is a DTensor over ranks {sorted(wrapper)}, which include TP peers {peers} "
                              "holding different shards of it: shard a TP model over its data-parallel ranks only "
                              "(fully_shard(..., mesh=mesh.dp_mesh), tplayers.make_2d_mesh)")


def tp_local(e: Entry) -> torch.Tensor:
    """This rank's TP-local tensor of ``e`` (a wrapper's DTensor gathered over its mesh: collective)."""
    t = e.tensor.detach()
    return t.full_tensor() if is_dtensor(t) else t


def writable(e: Entry) -> Tuple[torch.Tensor, Optional[Callable[[], None]]]:
    """(a tensor of ``e``'s TP-local shape to load into, and what to call after the load, or None when the
    tensor is ``e``'s own). For a wrapper's DTensor: a plain buffer, then this rank's piece of it copied into
    the wrapper's local tensor (cut locally, as the wrapper placed it: no communication)."""
    t = e.tensor.detach()
    if not is_dtensor(t):
        return t, None
    from torch.distributed.tensor import distribute_tensor

    local = t.to_local()
    buffer = torch.empty(tuple(t.shape), dtype=t.dtype, device=local.device)

    def finish() -> None:
        local.copy_(distribute_tensor(buffer, t.device_mesh, t.placements, src_data_rank=None).to_local())
    return buffer, finish


def refuse_meta(entries: List[Entry], path: str) -> None:
    """Loading into meta tensors is a silent no-op (copy_ into meta does nothing): refuse it."""
    meta = [e.name for e in entries if e.tensor.device.type == "meta"]
    if meta:
        raise CheckpointError(f"{path}: cannot load into tensors on the meta device {meta[:5]}"
                              f"{' ...' if len(meta) > 5 else ''}; allocate them first "
                              "(model.to_empty(device=...), then re-tie tied weights)")


def parts_of(e: Entry) -> Iterator[Tuple[str, int, Part, Piece]]:
    """(key, full offset, Part, this rank's Piece) of each part of a sharded entry."""
    assert e.layout is not None and e.group is not None
    multi = len(e.layout.parts) > 1
    full_off = 0
    for i, (part, piece) in enumerate(zip(e.layout.parts, e.layout.pieces(e.group.rank, e.group.size))):
        yield (f"{e.name}.__part{i}" if multi else e.name), full_off, part, piece
        full_off += part.size


def _full_tensor(e: Entry) -> torch.Tensor:
    """The dense tensor of one entry, in the original model's orientation (collective over its TP group)."""
    t = tp_local(e)
    if e.layout is not None:
        assert e.group is not None
        t = gather_placed(t, e.layout, group=e.group)
    if e.transposed:
        t = t.t()
    return t.contiguous()


def dense_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The unsharded state dict of a TP model, as the dense model would name and shape it.

    Collective over the model's TP groups. Tied tensors appear once, under their first name.
    """
    return {e.name: _full_tensor(e) for e in entries(model)}
