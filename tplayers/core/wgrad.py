"""Weight gradients computed later: the W pass of a split backward (ZeroBubble, TransformerEngine's
``delay_wgrad_compute``).

A layer built with ``delay_wgrad=True`` computes only its input gradient in ``loss.backward()`` (the
chain the previous pipeline stage waits for) and records its weight-gradient GEMMs here;
:meth:`WeightGradStore.flush` (``tplayers.backward_dw(model)``) runs them later and accumulates the
results into ``.grad`` exactly as the normal backward would (through the same autograd path from the
tensor the layer consumed to its parameter: autocast's cast, the sum over replicated KV heads).
Gradients are identical to the normal path: the same GEMMs on the same tensors, at another time.

Until it is flushed, a store holds each recorded step's output gradient and input (activation
memory), and the parameters' ``.grad`` lacks those contributions: flush before ``optimizer.step()``,
on every rank, in the same order (under sequence parallelism a flush all-gathers the saved input).
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Optional, Sequence, Tuple

import torch

__all__ = ["WeightGradStore"]

Compute = Callable[[], Sequence[Optional[torch.Tensor]]]


class WeightGradStore:
    """A FIFO of recorded weight-gradient work: ``put`` during backward, ``flush`` later."""

    def __init__(self) -> None:
        self._work: Deque[Tuple[Tuple[Optional[torch.Tensor], ...], Compute]] = deque()

    def put(self, targets: Sequence[Optional[torch.Tensor]], compute: Compute) -> None:
        """Record ``compute`` (returns one gradient per target, or None) for the tensors ``targets``:
        the weight and bias exactly as the layer's autograd Function received them."""
        self._work.append((tuple(targets), compute))

    def __len__(self) -> int:
        return len(self._work)

    def flush(self) -> int:
        """Run every recorded computation in recording order and accumulate each gradient into its
        parameter through autograd; returns how many ran."""
        count = 0
        while self._work:
            targets, compute = self._work.popleft()
            with torch.no_grad():
                grads = compute()
            pairs = [(t, g.to(t.dtype)) for t, g in zip(targets, grads)
                     if t is not None and g is not None and t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            count += 1
        return count

    def clear(self) -> None:
        """Drop the recorded work without running it (e.g. after a skipped step)."""
        self._work.clear()
