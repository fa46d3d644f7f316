"""What every tplayers module shares: its TP group, dense conversion, and its parameters' placements.

A :class:`TensorParallelModule` declares, for each direct parameter, its
:class:`~tplayers.core.placement.Placement`; :func:`model_placements` reads them for a whole model
(plus any placement a ``parallelize`` style recorded on a foreign module), and everything that moves
weights between dense and sharded form reads that map.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.nn as nn

from ..core.collectives import gather_placed
from ..core.groups import GroupLike, TPGroup
from ..core.placement import Placement

__all__ = ["TensorParallelModule", "model_placements", "placements_of", "PLACEMENTS_ATTR"]

# A module that is not a TensorParallelModule (a Hugging Face norm under sequence parallelism) carries
# its parameters' placements in this attribute, set by the parallelize style that changed how it runs.
PLACEMENTS_ATTR = "_tplayers_placements"


class TensorParallelModule(nn.Module):
    """Base of every tplayers module: it knows its TP group and converts to and from dense.

    ``to_dense()`` is collective (every rank of the group must call it) and returns a plain
    ``torch.nn`` module computing the same function, on every rank.
    """

    group: TPGroup

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "TensorParallelModule":
        raise NotImplementedError

    def to_dense(self) -> nn.Module:
        raise NotImplementedError

    def param_placements(self) -> Dict[str, Placement]:
        """Each direct parameter's :class:`~tplayers.core.placement.Placement`. A container module
        (its parameters all live in child TP modules) has none; a module with direct parameters
        must say how each one is placed."""
        direct = [name for name, _ in self.named_parameters(recurse=False)]
        if direct:
            raise NotImplementedError(f"{type(self).__name__} has parameters {direct} but does not define "
                                      "param_placements()")
        return {}

    def gather_param(self, name: str) -> torch.Tensor:
        """The dense tensor of direct parameter ``name``, on every rank (collective; no autograd)."""
        return gather_placed(getattr(self, name), self.param_placements()[name], group=self.group)


def placements_of(module: nn.Module) -> Dict[str, Placement]:
    """The placements of ``module``'s direct parameters that differ from plain replication."""
    if isinstance(module, TensorParallelModule):
        return module.param_placements()
    return dict(getattr(module, PLACEMENTS_ATTR, {}))


def model_placements(model: nn.Module) -> Dict[str, Placement]:
    """``{parameter name: Placement}`` for every parameter of ``model`` with a declared placement
    (names absent from it are replicated with a complete gradient). Pure: no communication."""
    out: Dict[str, Placement] = {}
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for pname, placement in placements_of(mod).items():
            out[prefix + pname] = placement
    return out
