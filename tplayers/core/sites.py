"""Where a collective comes from, in the words its checks use (:mod:`.fingerprint`): the path in the model of the
module whose forward issues it, recorded once per model (:func:`name_modules`), found by walking up the Python
frames (:func:`forward_site`), or what a read outside any forward computes (:func:`reading`)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Tuple

import torch

__all__ = ["name_modules", "reading", "forward_site", "in_a_forward"]


def name_modules(root: torch.nn.Module) -> None:
    """Record every submodule's path under ``root`` (a module keeps the first path it is given; the same on
    every rank of a SPMD program): what fingerprints and checks call it."""
    for name, module in root.named_modules():
        module.__dict__.setdefault("_tplayers_path", name or type(root).__name__)


_READING: List[Optional[str]] = [None]  # what a collective issued outside any module's forward is for


@contextmanager
def reading(what: str) -> Iterator[None]:
    """Name the collectives issued in the block by what they compute (``what``) rather than by the module
    running: a read of a deferred value (a :class:`~tplayers.regions.partial_sum.PartialSum`) happens wherever user code
    reads it, often outside any forward ("(no module)" said nothing)."""
    before, _READING[0] = _READING[0], what
    try:
        yield
    finally:
        _READING[0] = before


def forward_site(frame: Any) -> Tuple[str, bool, bool]:
    """The innermost module whose ``forward`` is running above ``frame``: its path, its training flag,
    and whether autograd tracks its inputs (grad mode itself is off inside an autograd Function's
    forward, where most collectives run: a non-parameter tensor among that forward's locals that
    requires grad tells a training forward from one under ``torch.no_grad``). Inside a :func:`reading` block, what
    it reads names the site instead."""
    inner, outer, tracked = None, None, torch.is_grad_enabled()
    for module, local in _module_forwards(frame):
        if inner is None:
            inner = module
            tracked = tracked or any(isinstance(v, torch.Tensor) and v.requires_grad
                                     and not isinstance(v, torch.nn.Parameter) for v in local.values())
            if "_tplayers_path" in module.__dict__:
                break
        outer = module
    if inner is None:
        return _READING[0] or "(no module)", False, tracked
    if "_tplayers_path" not in inner.__dict__:
        name_modules(outer)  # (a module run by one that does not hold it, e.g. an audit's copy: its class name)
        inner.__dict__.setdefault("_tplayers_path", type(inner).__name__)
    return _READING[0] or inner.__dict__["_tplayers_path"], inner.training, tracked


def in_a_forward(frame: Any) -> bool:
    """Whether a module's ``forward`` runs above ``frame`` (its hooks' calls included: they run under the forward of
    the model that called the module)."""
    return next(_module_forwards(frame), None) is not None


def _module_forwards(frame: Any) -> Iterator[Tuple[torch.nn.Module, dict]]:
    """``(module, the frame's locals)`` for every module whose ``forward`` runs above ``frame``, innermost first."""
    while frame is not None:
        if frame.f_code.co_name == "forward":
            local = frame.f_locals
            module = local.get("self")
            if isinstance(module, torch.nn.Module):
                yield module, local
        frame = frame.f_back
