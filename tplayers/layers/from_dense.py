"""A TP linear from dense weights and back: the ``nn.Linear`` init, loading this rank's pieces of full
parameters (checked equal on every rank), the dense ``nn.Linear`` rebuilt, and whether a module
really computes a plain linear (so that a conversion is exact)."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.blocking import bit_hash, ranks_that_differ
from .base import TensorParallelModule, class_name

__all__ = ["CAST_ATTR", "CastingLinear", "casts_weight_to_input", "dense_linear_init", "new_param", "load_full_params", "reset_linear_params", "linear_to_dense",
           "own_forward", "computes_linear", "computes_embedding", "stand_in", "check_dense_linear"]


CAST_ATTR = "cast_weight_to_input"  # a TP linear computing in its input's dtype (layers/weight_cast.py)


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
    probe, x, want = _linear_probe(module, torch.float32)  # (mixed dtypes refused on the probe: it does not cast)
    return _probe_matches(module, probe, x, want, rtol=1e-5, atol=1e-6)


def dense_linear_init(
    in_features: int, out_features: int, bias: bool, device: Any, dtype: Any
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The full weight and bias ``nn.Linear(in_features, out_features)`` would draw (same RNG calls)."""
    weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
    b = torch.empty(out_features, device=device, dtype=dtype) if bias else None
    if weight.device.type != "meta":
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if b is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            nn.init.uniform_(b, -bound, bound)
    return weight, b


def new_param(t: torch.Tensor, like: Optional[nn.Parameter] = None) -> nn.Parameter:
    """A parameter holding a copy of ``t``, with ``like``'s ``requires_grad`` (frozen stays frozen)."""
    requires_grad = True if like is None else like.requires_grad
    return nn.Parameter(t.detach().clone(), requires_grad=requires_grad)


def load_full_params(layer: TensorParallelModule, full: Dict[str, Optional[torch.Tensor]],
                     like: Optional[nn.Module] = None) -> None:
    """Set each named parameter of ``layer`` to this rank's shard of the dense tensor in ``full``
    (through the parameter's placement); ``like``: the dense module whose ``requires_grad`` to keep."""
    _require_same_on_every_rank(layer, full)
    placements = layer.param_placements()
    for name, t in full.items():
        if t is None:
            continue
        local = placements[name].shard(t, layer.group.rank, layer.group.size)
        if like is not None:
            setattr(layer, name, new_param(local, getattr(like, name)))
        elif getattr(layer, name).device.type != "meta":  # a meta layer stays uninitialized
            with torch.no_grad():
                getattr(layer, name).copy_(local)


def _require_same_on_every_rank(layer: TensorParallelModule, full: Dict[str, Optional[torch.Tensor]]) -> None:
    """Every rank cuts its shard from its own copy of the dense tensors: copies that differ (layers built
    under per-rank RNG states, or from_dense given a different module per rank) would be stitched into
    a layer no rank ever had. One all-gather of two hashes per tensor, at construction only."""
    named = [(n, t) for n, t in full.items() if t is not None and t.device.type != "meta"]
    if layer.group.size == 1 or not named:
        return
    differ = ranks_that_differ(torch.stack([bit_hash(t) for _, t in named]), group=layer.group)
    if differ.any():
        ranks, index = differ.nonzero()[0].tolist()
        raise ValueError(f"{type(layer).__name__}: the dense {named[index][0]} differs between rank 0 and rank {ranks} "
                         "of the TP group: build it under the same torch.manual_seed on every rank, or pass the same "
                         "dense module to from_dense on every rank (or build on the meta device and load a checkpoint)")


def reset_linear_params(layer: TensorParallelModule) -> None:
    """Redraw the full ``nn.Linear(in_features, out_features)`` init (the same RNG calls) and keep
    this rank's part of it, through each parameter's placement."""
    w, b = dense_linear_init(layer.in_features, layer.out_features, layer.bias is not None,
                             layer.weight.device, layer.weight.dtype)
    load_full_params(layer, {"weight": w, "bias": b})


def linear_to_dense(layer: TensorParallelModule) -> nn.Linear:
    """The full ``nn.Linear`` of a Column/Row/fused layer, gathered on every rank (collective)."""
    cls = CastingLinear if getattr(layer, CAST_ATTR, False) else nn.Linear  # (a forward casting its weight: kept)
    dense = cls(layer.in_features, layer.out_features, layer.bias is not None, device="meta")
    dense.weight = new_param(layer.gather_param("weight"), layer.weight)
    if layer.bias is not None:
        dense.bias = new_param(layer.gather_param("bias"), layer.bias)
    return dense


def own_forward(module: nn.Module, base: type) -> Optional[str]:
    """The name of the first class between ``type(module)`` and ``base`` that defines its own
    ``forward`` (a scaled embedding, a LoRA or quantized linear), None when it inherits base's."""
    for cls in type(module).__mro__:
        if cls is base:
            return None
        if issubclass(cls, base) and "forward" in vars(cls):
            return cls.__name__
    return None


def computes_linear(linear: nn.Module) -> bool:
    """Whether a module with its own forward (an ``nn.Linear`` subclass, or a class of its own holding a weight
    ``(out, in)`` and maybe a bias) computes ``x @ W.T + b`` (Falcon's ``FalconLinear`` spells it out by hand):
    probed in float64 with a small random weight of the same input width (the module's own weights are never
    copied), against ``F.linear``. Anything else (a scale, a quantized kernel, a forward that fails on the probe)
    is not."""
    return _probe_matches(linear, *_linear_probe(linear, torch.float64))


def _linear_probe(linear: nn.Module, x_dtype: torch.dtype) -> Tuple[Dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(a small random float64 weight (and bias) of ``linear``'s input width, an input ``(3, in)`` of ``x_dtype``,
    ``F.linear`` of them in ``x_dtype``): what :func:`computes_linear` and :func:`casts_weight_to_input` compare
    the module's forward with."""
    gen = torch.Generator().manual_seed(0)
    width, rows = linear.weight.shape[1], min(linear.weight.shape[0], 8)
    probe = {"weight": torch.randn(rows, width, generator=gen, dtype=torch.float64)}
    if getattr(linear, "bias", None) is not None:
        probe["bias"] = torch.randn(rows, generator=gen, dtype=torch.float64)
    x = torch.randn(3, width, generator=gen, dtype=x_dtype)  # (n, in)
    bias = probe["bias"].to(x_dtype) if "bias" in probe else None
    return probe, x, F.linear(x, probe["weight"].to(x_dtype), bias)


def computes_embedding(embedding: nn.Module) -> bool:
    """Whether a module holding a table ``weight (num, dim)`` computes ``F.embedding(ids, weight)``: probed as
    :func:`computes_linear` is (a table of the same rows, 8 wide at most)."""
    gen = torch.Generator().manual_seed(0)
    rows, width = embedding.weight.shape[0], min(embedding.weight.shape[1], 8)
    probe = {"weight": torch.randn(rows, width, generator=gen, dtype=torch.float64)}
    ids = torch.randint(0, rows, (2, 3), generator=gen)
    return _probe_matches(embedding, probe, ids, torch.nn.functional.embedding(ids, probe["weight"]))


def _probe_matches(module: nn.Module, probe: Dict[str, torch.Tensor], x: torch.Tensor, want: torch.Tensor,
                   rtol: float = 1e-12, atol: float = 1e-12) -> bool:
    try:
        with torch.no_grad():
            got = torch.func.functional_call(module, probe, (x,), strict=False)
    except Exception:  # a kernel that cannot run on the probe is not plain linear
        return False
    return (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
            and torch.allclose(got, want, rtol=rtol, atol=atol))


def stand_in(module: nn.Module, embedding: bool) -> Optional[nn.Module]:
    """For a module of its own class that is an ``nn.Linear`` (``embedding``: an ``nn.Embedding``) in all but name
    (gemma_pytorch's ``Linear`` / ``Embedding``: a weight, maybe a bias, nothing else held, and a forward the probe
    shows computes the same), that class holding the same Parameters: what a style splits in its place. Else None."""
    params = dict(module.named_parameters())
    weight, bias = params.get("weight"), params.get("bias")
    if (isinstance(module, (nn.Linear, nn.Embedding)) or list(module.children()) or list(module.buffers())
            or set(params) - {"weight", "bias"} or weight is None or weight.dim() != 2
            or (bias is not None and (embedding or bias.shape != weight.shape[:1]))):
        return None
    if not (computes_embedding(module) if embedding else computes_linear(module)):
        return None
    dense: nn.Module = (nn.Embedding(*weight.shape, device="meta") if embedding else
                        nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta"))
    dense.weight = weight
    if bias is not None:
        dense.bias = bias
    return dense


def check_dense_linear(linear: nn.Module, cls: type) -> None:
    """Refuse anything but an ``nn.Linear`` (or a subclass computing the same) in ``cls.from_dense``."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{cls.__name__}.from_dense expects an nn.Linear, got {class_name(linear)}")
    override = own_forward(linear, nn.Linear)
    if override is not None and not computes_linear(linear):
        raise TypeError(f"{cls.__name__}.from_dense: {type(linear).__name__} has its own forward "
                        f"({override}.forward); a plain TP layer would drop that behaviour")
