"""Digests of tensors' bits, computed where the tensors live (no host synchronization): what the ranks'
collectives carry to prove they share their inputs, generators and replicated parameters
(:func:`~.fingerprint.carry`), and what the occasional checks gather (``bit_hash``).

A digest is a wrapping int64 sum of the bits (floating values read as integers of their width), plain and
weighted by position: equal tensors digest equal on every rank; any changed bit changes it (but for
astronomically rare collisions); the shape is mixed in, so two batch sizes never collide.
"""
from __future__ import annotations

import zlib
from typing import Iterable, List, Sequence

import torch

__all__ = ["device_hash", "digests", "generator_states", "generators_digest", "joint_digest"]

_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd 64-bit constant (as a signed int64): mixes the two sums


def device_hash(t: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """Two int64 hashes of ``t``'s bits (a plain and a position-weighted wrapping sum) on ``t``'s device,
    ``chunk`` elements at a time (memory stays small for any tensor)."""
    flat = t.detach().reshape(-1)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.view(_INT[flat.element_size() if not flat.is_complex() else flat.element_size() // 2])
    elif flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        bits = flat[start:start + chunk].to(torch.int64)
        weights = torch.arange(start + 1, start + 1 + bits.numel(), dtype=torch.int64, device=bits.device)
        total += torch.stack([bits.sum(), (bits * weights).sum()])
    return total


def _shape_code(t: torch.Tensor) -> int:
    return zlib.crc32(f"{tuple(t.shape)}|{t.dtype}".encode())


def digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One int64 digest per tensor, ``(k,)`` on the first tensor's device (none: an empty CPU tensor)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    device = tensors[0].device
    rows = []
    for t in tensors:
        plain, weighted = device_hash(t).to(device).unbind()
        rows.append(plain * _MIX + weighted + _shape_code(t))
    return torch.stack(rows)


def joint_digest(tensors: Iterable[torch.Tensor], small: int = 1 << 16) -> torch.Tensor:
    """One int64 digest of all ``tensors`` together, ``(1,)``: tensors under ``small`` elements are read in
    one concatenation per element width (a few kernels for a whole model's norms and biases), larger ones
    one by one. For naming which tensor differs, digest them one by one (:func:`digests`)."""
    by_width: dict = {}
    large: List[torch.Tensor] = []
    for t in tensors:
        t = t.detach()
        if t.numel() >= small:
            large.append(t)
        elif t.numel():
            flat = t.reshape(-1)
            if flat.is_floating_point():
                flat = flat.view(_INT[flat.element_size()])
            by_width.setdefault((flat.device, flat.element_size()), []).append(flat.to(_INT[flat.element_size()]))
    parts = [torch.cat(flats) for flats in by_width.values()] + large
    if not parts:
        return torch.zeros(1, dtype=torch.int64)
    return digests(parts).sum(0, keepdim=True)


def generator_states() -> List[torch.Tensor]:
    """The default CPU generator's state and (when CUDA is initialized) the current CUDA device's (a CUDA
    generator's state is its seed and offset, kept on the host: no synchronization)."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def generators_digest() -> torch.Tensor:
    """``(k,)`` int64: a CRC of each of :func:`generator_states` (read on the host)."""
    return torch.tensor([zlib.crc32(s.numpy().tobytes()) for s in generator_states()], dtype=torch.int64)
