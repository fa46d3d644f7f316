"""Checks on inputs every rank holds whole (token ids, targets): local, with no communication.

Every rank sees the same ids, so each can check them alone and all raise together. On CPU the check
is a compare and an ``any()``; on an accelerator, and inside ``torch.compile``, it is
``torch._assert_async``: a device-side assert, no host sync per step and no data-dependent branch for
the compiler (a bad id then surfaces as an assert at the next synchronization, with this message).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["check_index_range"]


def check_index_range(index: torch.Tensor, size: int, what: str, ignore_index: Optional[int] = None) -> None:
    """Raise IndexError unless every value of ``index`` is in ``[0, size)`` (or equals ``ignore_index``)."""
    if index.numel() == 0:
        return
    bad = (index < 0) | (index >= size)
    if ignore_index is not None:
        bad &= index != ignore_index
    allowed = f"[0, {size})" + (f" or ignore_index={ignore_index}" if ignore_index is not None else "")
    if index.device.type != "cpu" or torch.compiler.is_compiling():
        # no data-dependent Python branch: torch.compile(fullgraph=True) traces this as one op
        torch._assert_async(~bad.any(), f"{what}: a value is outside {allowed}")
        return
    if bool(bad.any()):
        value = int(index[bad].flatten()[0])
        raise IndexError(f"{what}: index {value} is out of range: it must be in {allowed}")
