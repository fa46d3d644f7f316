"""Linears that cast their weight to the input's dtype in forward, kept so when split.

nanochat's ``Linear`` (and modded-nanogpt's ``CastedLinear``) replaces autocast by hand: float32 master weights
for the optimizer, the matmul in the activations' dtype::

    def forward(self, x):
        return F.linear(x, self.weight.to(dtype=x.dtype))      # x bfloat16, weight float32

A plain TP layer swapped in would refuse the mixed dtypes (or, worse, compute in float32). `parallelize` probes
each Linear-like module it splits (:func:`casts_weight_to_input`) and marks the TP layer
``cast_weight_to_input``; its forward (:func:`computes_in_input_dtype`) then runs under ``torch.autocast`` of
the input's dtype whenever that differs from the weight's: autocast's cast is the same ``weight.to(x.dtype)``,
recorded by autograd, so the weight gradients reach the float32 parameters as the dense model's do, and every
path of the TP layers (overlap, siblings, main_grad, the invariant tree) already knows it. Its dense twin and
``to_dense()`` give :class:`CastingLinear`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["CastingLinear", "casts_weight_to_input", "computes_in_input_dtype", "CAST_ATTR"]

CAST_ATTR = "cast_weight_to_input"
_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


class CastingLinear(nn.Linear):
    """``nn.Linear`` computing in its input's dtype: ``F.linear(x, weight.to(x.dtype), bias.to(x.dtype))``.
    The dense form of a TP linear with ``cast_weight_to_input`` (``to_dense()``, the audit's twin)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


def casts_weight_to_input(module: nn.Module) -> bool:
    """Whether ``module`` (a Linear-like module with a forward of its own) casts its weight (and bias) to the
    input's dtype: probed with a float64 weight and a float32 input, against ``F.linear`` in float32 (its own
    weights are never read; a forward that fails on the probe does not cast)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or type(module).forward is nn.Linear.forward:
        return False
    gen = torch.Generator().manual_seed(0)
    rows, width = min(weight.shape[0], 8), weight.shape[1]
    probe = {"weight": torch.randn(rows, width, generator=gen, dtype=torch.float64)}
    if isinstance(getattr(module, "bias", None), torch.Tensor):
        probe["bias"] = torch.randn(rows, generator=gen, dtype=torch.float64)
    x = torch.randn(3, width, generator=gen)  # (n, in), float32
    want = F.linear(x, probe["weight"].float(), probe["bias"].float() if "bias" in probe else None)
    try:
        with torch.no_grad():
            got = torch.func.functional_call(module, probe, (x,), strict=False)
    except Exception:  # mixed dtypes refused: it does not cast
        return False
    return (isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == want.shape
            and torch.allclose(got, want, rtol=1e-5, atol=1e-6))


def computes_in_input_dtype(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A TP linear's ``forward``, run under ``torch.autocast`` of the input's dtype when the layer has
    ``cast_weight_to_input`` and the input's dtype differs from the weight's (autocast off; under an outer
    autocast the dense forward computes in autocast's dtype too). Off: one attribute read."""

    @functools.wraps(forward)
    def run(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not getattr(self, CAST_ATTR, False) or x.dtype == self.weight.dtype or not x.is_floating_point() \
                or torch.is_autocast_enabled(x.device.type):
            return forward(self, x, *args, **kwargs)
        _require_autocast_dtype(self, x.dtype)
        with torch.autocast(x.device.type, dtype=x.dtype):
            return forward(self, x, *args, **kwargs)
    return run


def _require_autocast_dtype(layer: nn.Module, dtype: Optional[torch.dtype]) -> None:
    if dtype not in _AUTOCAST_DTYPES:
        raise TypeError(f"{type(layer).__name__}: computes in its input's dtype (the Linear it replaced cast its "
                        f"weight to it), which it does under torch.autocast: bfloat16 or float16 inputs; got a "
                        f"{dtype} input for {layer.weight.dtype} weights (cast the model to one dtype)")
