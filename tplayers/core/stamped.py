"""What a collective sends and receives: the caller's data, and with the ranks-in-step checks on, ``SLOT``
elements per rank of fingerprint (:mod:`.fingerprint`) in the same buffer; how the result comes back (the slots
checked and stripped). Without a stamp each is the caller's own buffer, and the finish returns it.

Each ``*_buffers`` returns ``(send, receive, finish)``: the collective moves ``send`` into ``receive`` (an
all-reduce: in place, ``send is receive``) and ``finish()`` is its result once complete.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .fingerprint import SLOT, Stamp

__all__ = ["all_reduce_buffers", "all_gather_buffers", "reduce_scatter_buffers"]

Buffers = Tuple[torch.Tensor, torch.Tensor, Callable[[], torch.Tensor]]

# Fingerprinted all-reduces sum in a longer buffer than the caller's, then copy back. Reused: fresh
# pages cost more than the copy (a 2 MB buffer on the CPU: +2.4 ms fresh, +0.8 ms reused, per all-reduce).
_SCRATCH: List[torch.Tensor] = []


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    for i, t in enumerate(_SCRATCH):
        if t.numel() == numel and t.dtype == dtype and t.device == device:
            return _SCRATCH.pop(i)
    if len(_SCRATCH) >= 8:
        _SCRATCH.pop(0)
    return torch.empty(numel, dtype=dtype, device=device)


def _not_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on ``t``'s device (no synchronization): some element of ``t`` is inf or nan."""
    return ~torch.isfinite(t).all()


def all_reduce_buffers(buf: torch.Tensor, s: Optional[Stamp], check_finite: bool) -> Buffers:
    """An all-reduce of ``buf`` (summed in place): with a stamp, ``buf``'s n elements then ``p * SLOT`` slots (this
    rank's fingerprint, and whether ``buf`` is finite when ``check_finite``, in its own; zeros elsewhere)."""
    if s is None:
        return buf, buf, lambda: buf
    n = buf.numel()
    flat = _scratch(n + s.size * SLOT, buf.dtype, buf.device)
    flat[:n].view(buf.shape).copy_(buf)
    flat[n:].copy_(s.slots(buf.dtype, buf.device, _not_finite(buf) if check_finite else None))

    def finish() -> torch.Tensor:
        try:
            s.check(flat[n:])
            return buf.copy_(flat[:n].view(buf.shape))
        finally:
            _SCRATCH.append(flat)
    return flat, flat, finish


def all_gather_buffers(src: torch.Tensor, size: int, s: Optional[Stamp]) -> Buffers:
    """An all-gather of ``src`` (contiguous) along dim 0 into ``(size * d0, ...)``: with a stamp each rank sends its
    n elements then its ``SLOT`` fingerprint, and receives ``size`` such rows."""
    full = (size * src.shape[0],) + tuple(src.shape[1:])
    if s is None:
        out = torch.empty(full, dtype=src.dtype, device=src.device)
        return src, out, lambda: out
    n = src.numel()
    ext = torch.cat([src.reshape(-1), s.mine(src.dtype, src.device)])
    rows = torch.empty((size, n + SLOT), dtype=src.dtype, device=src.device)

    def finish() -> torch.Tensor:
        s.check(rows[:, n:])
        return rows[:, :n].reshape(full)
    return ext, rows.view(-1), finish


def reduce_scatter_buffers(src: torch.Tensor, size: int, out_shape: Sequence[int], s: Optional[Stamp],
                           check_finite: bool) -> Buffers:
    """A reduce-scatter of ``src`` (``size`` contiguous blocks, block r rank r's chunk in ``out_shape``'s layout):
    with a stamp every block carries the ``size * SLOT`` slots (this rank's in its own), so each rank's chunk of
    the sum has all of them."""
    if s is None:
        out = torch.empty(out_shape, dtype=src.dtype, device=src.device)
        return src.view(-1), out.view(-1), lambda: out
    m = src.numel() // size
    flag = _not_finite(src) if check_finite else None
    blocks = torch.cat([src.view(size, m), s.slots(src.dtype, src.device, flag).expand(size, -1)], dim=1)
    out = torch.empty(m + size * SLOT, dtype=src.dtype, device=src.device)

    def finish() -> torch.Tensor:
        s.check(out[m:])
        return out[:m].view(out_shape)
    return blocks.view(-1), out, finish
