"""Dropout randomness for tensor parallelism: one seed, two streams, checkpoint-safe.

Dropout on a sharded activation (attention heads, or a sequence shard) must draw different
masks on different ranks, or every shard would be dropped in the same pattern; dropout on a
replicated activation must draw the same mask on every rank, or the replicas would diverge.

`RNGTracker(seed, group=g)` keeps both streams, each a full generator state per device:

- ``"replicated"``: seeded with ``seed`` on every rank;
- ``"parallel"``: seeded with ``seed + parallel_offset + rank``.

``with tracker.fork("parallel", device):`` swaps the stream into the device's default
generator (which ``F.dropout`` and SDPA use), and on exit saves the advanced stream and puts
the caller's state back, so code outside the fork sees its own RNG untouched. Works on CPU and
CUDA generators. Modules take the tracker explicitly (``rng=``): there is no global tracker.

Activation checkpointing: ``tracker.checkpoint(fn, *args)`` is ``torch.utils.checkpoint``
(non-reentrant) that also rewinds the tracker's streams for the recomputation, so recomputed
dropout masks equal the original ones.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..core.blocking import ranks_that_differ
from ..core.groups import GroupLike, TPGroup, resolve_group

__all__ = ["RNGTracker", "PARALLEL", "REPLICATED", "dropout_context", "require_rng", "activation_dropout"]

PARALLEL = "parallel"
REPLICATED = "replicated"
_REGIONS = (PARALLEL, REPLICATED)

_Key = Tuple[str, str, Optional[int]]


def _device_key(device: Any) -> Tuple[str, Optional[int]]:
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cuda":
        return "cuda", dev.index if dev.index is not None else torch.cuda.current_device()
    if dev.type != "cpu":
        raise ValueError(f"RNGTracker supports CPU and CUDA generators, got device {dev}")
    return "cpu", None


def _get_state(dev_type: str, index: Optional[int]) -> torch.Tensor:
    return torch.cuda.get_rng_state(index) if dev_type == "cuda" else torch.get_rng_state()


def _set_state(dev_type: str, index: Optional[int], state: torch.Tensor) -> None:
    if dev_type == "cuda":
        torch.cuda.set_rng_state(state, index)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Two RNG streams (``"parallel"``, ``"replicated"``) derived from one seed; see the module doc."""

    def __init__(self, seed: int, *, group: GroupLike, parallel_offset: int = 2718) -> None:
        self.group = resolve_group(group)
        self.seed = int(seed)
        # Collective (one tiny all-gather): a seed that differs across ranks would give replicated
        # activations different dropout masks on each rank, silently.
        seeds = torch.tensor([[self.seed, parallel_offset]], dtype=torch.int64)
        differ = ranks_that_differ(seeds, group=self.group)[:, 0]
        if differ.any():
            raise ValueError(f"RNGTracker: seed={self.seed}, parallel_offset={parallel_offset} on rank {self.group.rank}, "
                             f"but rank(s) {differ.nonzero().flatten().tolist()} of the TP group passed a different "
                             "one than rank 0: pass the same seed on every rank (the tracker derives the per-rank "
                             "streams itself)")
        self.seeds = {REPLICATED: self.seed, PARALLEL: self.seed + parallel_offset + self.group.rank}
        self._states: Dict[_Key, torch.Tensor] = {}
        self._active: Dict[Tuple[str, Optional[int]], List[_Key]] = {}  # per device: the forks open, innermost last

    def __repr__(self) -> str:
        return f"RNGTracker(seed={self.seed}, tp_rank={self.group.rank}, tp_size={self.group.size})"

    def _initial_state(self, region: str, dev_type: str, index: Optional[int]) -> torch.Tensor:
        device = torch.device(dev_type, index) if dev_type == "cuda" else torch.device("cpu")
        return torch.Generator(device=device).manual_seed(self.seeds[region]).get_state()

    def get_states(self) -> Dict[_Key, torch.Tensor]:
        """A copy of every stream's current state (to save, or to rewind with `set_states`)."""
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: Dict[_Key, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, region: str = PARALLEL, device: Any = None) -> Iterator[None]:
        """Run the body with ``region``'s stream as ``device``'s default generator. Forks nest as in
        Megatron: an inner fork (of this stream or the other) continues each stream where it is live,
        and leaving it puts the enclosing fork's live stream back."""
        if region not in _REGIONS:
            raise ValueError(f"RNGTracker.fork: region must be one of {_REGIONS}, got {region!r}")
        dev_type, index = _device_key(device)
        key, active = (region, dev_type, index), self._active.setdefault((dev_type, index), [])
        caller = _get_state(dev_type, index)
        if active:  # the enclosing fork's stream is live in the generator: keep where it got to
            self._states[active[-1]] = caller
        state = self._states.get(key)
        _set_state(dev_type, index, state if state is not None else self._initial_state(region, dev_type, index))
        active.append(key)
        try:
            yield
        finally:
            active.pop()
            self._states[key] = _get_state(dev_type, index)
            _set_state(dev_type, index, self._states[active[-1]] if active else caller)

    def checkpoint(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` whose recomputation
        replays the tracker's streams from where the forward started them."""
        at_forward: Dict[str, Dict[_Key, torch.Tensor]] = {}

        @contextlib.contextmanager
        def forward_ctx() -> Iterator[None]:
            at_forward["states"] = self.get_states()
            yield

        @contextlib.contextmanager
        def recompute_ctx() -> Iterator[None]:
            current = self.get_states()
            self.set_states(at_forward["states"])
            try:
                yield
            finally:
                self.set_states(current)

        return torch.utils.checkpoint.checkpoint(
            fn, *args, use_reentrant=False, context_fn=lambda: (forward_ctx(), recompute_ctx()), **kwargs)


def dropout_context(rng: Optional[RNGTracker], region: str, device: Any):
    """``rng.fork(region, device)``, or a no-op without a tracker (a world of one)."""
    return contextlib.nullcontext() if rng is None else rng.fork(region, device)


def require_rng(rng: Optional[RNGTracker], tp: TPGroup, layer: str, what: str, p: float) -> None:
    """Refuse a dropout probability outside [0, 1), or dropout at TP > 1 without a tracker."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{layer}: {what}={p} must be in [0, 1)")
    if p > 0 and tp.size > 1 and rng is None:
        raise ValueError(f"{layer}: {what}={p} at TP degree {tp.size} needs rng=tplayers.RNGTracker(seed, group=...) "
                         "so that dropout masks differ across shards and agree across replicas")


def activation_dropout(x: torch.Tensor, p: float, rng: Optional[RNGTracker], sequence_parallel: bool) -> torch.Tensor:
    """Dropout on an activation between TP regions: the same mask on every rank when it is
    replicated, per-rank masks when it is a sequence shard (``sequence_parallel``)."""
    if p == 0:
        return x
    region = PARALLEL if sequence_parallel else REPLICATED
    with dropout_context(rng, region, x.device):
        return F.dropout(x, p)
