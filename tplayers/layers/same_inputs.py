"""`check_same_inputs`: the TP ranks of one replica must be fed the same batch (opt-in, per forward).

Every rank of a TP group computes on the same activations; a data loader that gives each rank a
different batch (Lightning's or DDP's distributed sampler over the TP ranks) trains a model that is
no rank's and no dense model's, silently. `check_same_inputs` makes that loud: a forward pre-hook
that hashes every tensor argument and compares the hashes across the TP group.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..core.collectives import bit_hash, ranks_that_differ
from ..core.groups import GroupLike, resolve_group

__all__ = ["check_same_inputs"]


def check_same_inputs(module: nn.Module, *, group: GroupLike, every: int = 1) -> RemovableHandle:
    """Check, before every ``every``-th forward of ``module``, that each tensor argument is bitwise
    equal on every rank of the TP group; raise ValueError on every rank otherwise, naming the
    argument and the ranks that differ. Returns the hook handle (``.remove()`` to stop).

    Cost per checked forward: each input hashed (read once; on CUDA the hash is copied to the host,
    one sync) and one all-gather of two int64 per tensor argument. Meant for the first steps of a
    run or a debugging session; ``every=100`` keeps it as a cheap periodic audit.
    """
    tp = resolve_group(group)
    if every < 1:
        raise ValueError(f"check_same_inputs: every={every} must be >= 1")
    calls = [0]

    def hook(_: nn.Module, args: Tuple[Any, ...], kwargs: dict) -> None:
        calls[0] += 1
        if tp.size == 1 or (calls[0] - 1) % every:
            return
        named = [(f"argument {i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        named += [(f"argument '{k}'", v) for k, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor)]
        if not named:
            return
        # the shape goes into the hash too: two ranks with different batch sizes must not collide
        hashes = torch.stack([torch.cat([bit_hash(t), torch.tensor([hash(tuple(t.shape)) & (2**62 - 1)])])
                              for _, t in named])
        differ = ranks_that_differ(hashes, group=tp)  # (p, n)
        if differ.any():
            ranks, index = differ.nonzero()[0].tolist()
            raise ValueError(f"check_same_inputs: {type(module).__name__} forward #{calls[0]}: {named[index][0]} "
                             f"differs between rank 0 and rank {ranks} of the TP group: every TP rank must see the "
                             "same batch (a distributed sampler over the TP ranks splits it; in Lightning pass "
                             "use_distributed_sampler=False when data_parallel_size=1)")

    return module.register_forward_pre_hook(hook, with_kwargs=True)
