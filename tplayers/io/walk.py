"""The model as the io floor sees it: every persistent tensor with its placement, TP group, tied
aliases and whether its dense form is transposed (GPT-2 ``Conv1D``); and the dense state dict."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ..core.collectives import gather_placed
from ..core.groups import TPGroup
from ..core.placement import Part, Piece, Sharded
from ..layers.base import TensorParallelModule, placements_of

__all__ = ["CheckpointError", "Entry", "entries", "refuse_meta", "parts_of", "dense_state_dict"]


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
            if type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor":
                raise CheckpointError(f"'{name}' is a DTensor (FSDP2 or DTensor TP): tplayers checkpoints handle "
                                      "tplayers TP modules (plain or DDP-wrapped); use torch.distributed.checkpoint "
                                      "with get_model_state_dict for FSDP2-sharded models")
            if id(t) in seen:
                seen[id(t)].aliases += (name,)
                continue
            layout = layouts.get(pname)
            if layout is not None and not layout.is_sharded:
                layout = None
            tp = mod.group if isinstance(mod, TensorParallelModule) else None
            e = Entry(name, t, layout, tp, bool(getattr(mod, "dense_transposed", False)) and pname == "weight")
            seen[id(t)] = e
            out.append(e)
    return out


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
    t = e.tensor.detach()
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
