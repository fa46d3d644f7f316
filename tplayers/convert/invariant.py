"""``parallelize(..., tp_invariant=True)``: which converted layers take the fixed-tree path (`tplayers.core.invariant`),
and what this first version refuses, named, before the model runs."""
from __future__ import annotations

from typing import Iterable, Tuple

import torch.nn as nn

from ..core.groups import TPGroup
from ..core.invariant import check_invariant
from ..layers.base import TensorParallelModule
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..layers.vocab import ParallelLMHead, VocabParallelEmbedding

__all__ = ["apply_tp_invariant"]


def apply_tp_invariant(modules: Iterable[Tuple[str, nn.Module]], tp: TPGroup, sequence_parallel: bool,
                       loss_parallel: bool) -> None:
    """Put the column / row layers and the LM head among the built ``(name, module)`` on the fixed-tree path,
    after checking them all; refuse what would still sum in a TP-dependent order. The embedding needs nothing:
    a token's row is on one rank (the sum over ranks adds zeros)."""
    if sequence_parallel or loss_parallel:
        raise ValueError("parallelize: tp_invariant=True is not available with "
                         f"{'sequence_parallel' if sequence_parallel else 'loss_parallel'}=True yet (the norms' partial "
                         "gradients and the vocabulary-parallel softmax sums are not summed as the fixed tree); "
                         "drop it, or tp_invariant")
    check_invariant(tp.size, "parallelize")
    layers = [(n, m) for n, m in modules if isinstance(m, TensorParallelModule)
              and not isinstance(m, VocabParallelEmbedding)]
    for name, module in layers:
        what = f"parallelize: tp_invariant=True: module '{name}' ({type(module).__name__})"
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            raise ValueError(f"{what} sums over ranks in its own way; this version takes column / row layers, the "
                             "vocabulary-parallel embedding and LM head (no fused projections, experts, mixers)")
        split = getattr(module, "split", None)
        if split is not None and split.is_uneven:
            raise ValueError(f"{what} is split unevenly; the fixed tree needs whole leaves on every rank")
        if isinstance(module, RowParallelLinear) and not module.input_is_parallel:
            raise ValueError(f"{what} takes a whole input (input_is_parallel=False); give it the column layer's shard")
        check_invariant(tp.size, what, module.in_features if isinstance(module, RowParallelLinear) else
                        module.weight.shape[0] * tp.size)  # (the head: its vocabulary padded to the TP degree)
    for _, module in layers:
        module.tp_invariant = True
