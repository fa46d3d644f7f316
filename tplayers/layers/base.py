"""What every tplayers module shares: its TP group, dense conversion, and its parameters' placements.

A :class:`TensorParallelModule` declares, for each direct parameter, its
:class:`~tplayers.core.placement.Placement`; :func:`model_placements` reads them for a whole model
(plus any placement a ``parallelize`` style recorded on a foreign module), and everything that moves
weights between dense and sharded form reads that map.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..core.collectives import bit_hash, gather_placed, ranks_that_differ
from ..core.validate import require_chunks
from ..core.wgrad import ReplicatedRows, WeightGradStore
from ..core.groups import GroupLike, TPGroup
from ..core.placement import Placement

__all__ = ["TensorParallelModule", "model_placements", "placements_of", "set_overlap_comm", "set_overlap", "PLACEMENTS_ATTR",
           "dense_linear_init", "new_param", "load_full_params", "reset_linear_params", "linear_to_dense", "check_dense_linear", "own_forward",
           "computes_linear"]

# A module that is not a TensorParallelModule (a Hugging Face norm under sequence parallelism) carries
# its parameters' placements in this attribute, set by the parallelize style that changed how it runs.
PLACEMENTS_ATTR = "_tplayers_placements"


class TensorParallelModule(nn.Module):
    """Base of every tplayers module: it knows its TP group and converts to and from dense.

    ``to_dense()`` is collective (every rank of the group must call it) and returns a plain
    ``torch.nn`` module computing the same function, on every rank.
    """

    tp: TPGroup

    @classmethod
    def from_dense(cls, dense: nn.Module, *, group: GroupLike, **options: Any) -> "TensorParallelModule":
        raise NotImplementedError

    def to_dense(self) -> nn.Module:
        raise NotImplementedError

    def param_placements(self) -> Dict[str, Placement]:
        """Each direct parameter's :class:`~tplayers.core.placement.Placement`. A container module
        (its parameters all live in child TP modules) has none; a module with direct parameters
        must say how each one is placed."""
        direct = [name for name, _ in self.named_parameters(recurse=False)]
        if direct:
            raise NotImplementedError(f"{type(self).__name__} has parameters {direct} but does not define "
                                      "param_placements()")
        return {}

    def gather_param(self, name: str) -> torch.Tensor:
        """The dense tensor of direct parameter ``name``, on every rank (collective; no autograd)."""
        return gather_placed(getattr(self, name), self.param_placements()[name], group=self.tp)


def placements_of(module: nn.Module) -> Dict[str, Placement]:
    """The placements of ``module``'s direct parameters that differ from plain replication."""
    if isinstance(module, TensorParallelModule):
        return module.param_placements()
    return dict(getattr(module, PLACEMENTS_ATTR, {}))


def model_placements(model: nn.Module) -> Dict[str, Placement]:
    """``{parameter name: Placement}`` for every parameter of ``model`` with a declared placement
    (names absent from it are replicated with a complete gradient). Pure: no communication."""
    out: Dict[str, Placement] = {}
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for pname, placement in placements_of(mod).items():
            out[prefix + pname] = placement
    return out


def set_overlap_comm(model: nn.Module, enabled: bool) -> int:
    """Switch the backward overlap of every TP layer in ``model`` on or off; returns how many
    layers it set. Off gives the same ops with blocking collectives (bit-identical results),
    e.g. for benchmarks or a ``torch.compile(fullgraph=True)`` graph."""
    count = 0
    for module in model.modules():
        if isinstance(module, TensorParallelModule) and hasattr(module, "overlap_comm"):
            module.overlap_comm = bool(enabled)
            count += 1
    return count


def set_overlap(model: nn.Module, *, comm: Optional[bool] = None, split_backward: Optional[bool] = None,
                chunks: Optional[int] = None, delay_wgrad: Optional[bool] = None,
                collective_matmul: Optional[bool] = None) -> Dict[str, int]:
    """One model-wide switch for the overlap modes; ``None`` leaves a mode as each module has it.

    ``comm``: backward collectives asynchronous under the weight-gradient GEMMs (every TP layer's
    ``overlap_comm``; off = the same ops blocking). ``split_backward``: modules that can run several
    layers' weight gradients under one collective (``ParallelMLP``, ``ParallelAttention``) do so.
    ``chunks``: those modules run their batch in that many chunks, each chunk's collectives in flight
    under the next chunk's compute (1 = unchunked). ``delay_wgrad``: every TP linear records its
    weight-gradient GEMMs during backward for :func:`backward_dw` to run later.
    ``collective_matmul``: every sequence-parallel TP linear runs its forward all-gather /
    reduce-scatter (and the row layer its backward all-gather) as p ring steps under its GEMMs
    (layers without sequence parallelism are left alone; fused regions then run as their two
    layers). Returns how many modules each setting reached."""
    counts = {"comm": 0, "split_backward": 0, "chunks": 0, "delay_wgrad": 0, "collective_matmul": 0}
    if chunks is not None:
        require_chunks(chunks, "set_overlap")
    if comm is not None:
        counts["comm"] = set_overlap_comm(model, comm)
    for name, value in (("split_backward", split_backward), ("chunks", chunks), ("delay_wgrad", delay_wgrad)):
        if value is None:
            continue
        if name == "delay_wgrad" and not value and pending_wgrad(model):
            raise RuntimeError(f"set_overlap: delay_wgrad=False with {pending_wgrad(model)} recorded weight-gradient "
                               "computations not run yet: call tplayers.backward_dw(model) first")
        for module in model.modules():
            if isinstance(module, TensorParallelModule) and hasattr(module, name):
                setattr(module, name, value if name == "chunks" else bool(value))
                counts[name] += 1
    if collective_matmul is not None:
        for module in model.modules():
            if hasattr(module, "collective_matmul") and getattr(module, "sequence_parallel", False):
                module.collective_matmul = bool(collective_matmul)
                counts["collective_matmul"] += 1
    return counts


def grad_sinks(layer: nn.Module) -> Dict[str, Any]:
    """The ``wgrad_store`` / ``main_grads`` keyword arguments of a TP linear's fused op."""
    main = None
    if layer.accumulate_main_grad:
        main = (layer.weight.main_grad, None if layer.bias is None else layer.bias.main_grad)
        runs = layer.replica_runs() if getattr(layer, "has_replicas", False) else ()
        if runs:  # KV heads shared by several ranks: each step's contribution summed over them first
            main = tuple(None if buf is None else ReplicatedRows(buf, runs) for buf in main)
    return {"wgrad_store": layer.wgrad_store if layer.delay_wgrad else None, "main_grads": main,
            "collective_matmul": layer.collective_matmul}


def use_main_grad(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Give every TP linear's weight and bias a zeroed ``main_grad`` buffer of ``dtype`` and make the
    weight-gradient GEMMs accumulate into it (Megatron's gradient_accumulation_fusion): ``.grad`` of
    those parameters stays None. Rows replicated over ranks (fewer KV heads than ranks) gain each
    backward's contribution summed over their replica ranks, as ``.grad`` would (per backward, one
    all-reduce per run of such rows for the weight and one for the bias). Hand-off: :func:`main_grads_to_grads` before the optimizer step,
    :func:`zero_main_grads` after it. Returns how many layers it set."""
    count = 0
    for module in model.modules():
        if not hasattr(module, "accumulate_main_grad"):
            continue
        for p in (module.weight, module.bias):
            if p is not None and getattr(p, "main_grad", None) is None:
                p.main_grad = torch.zeros(p.shape, dtype=dtype, device=p.device)
        module.accumulate_main_grad = True
        count += 1
    return count


def _main_grad_params(model: nn.Module) -> List[nn.Parameter]:
    return [p for p in model.parameters() if getattr(p, "main_grad", None) is not None]


def main_grads_to_grads(model: nn.Module) -> int:
    """Hand the accumulated ``main_grad`` buffers to a torch optimizer: ``p.grad`` becomes the buffer
    itself when the dtypes agree (float32 parameters: no copy) or a cast copy (bfloat16 parameters:
    the accumulation was in float32, the hand-off rounds once). Returns how many parameters."""
    params = _main_grad_params(model)
    for p in params:
        p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
    return len(params)


def zero_main_grads(model: nn.Module) -> None:
    """Zero every ``main_grad`` buffer (after the optimizer step; ``optimizer.zero_grad`` does not)."""
    for p in _main_grad_params(model):
        p.main_grad.zero_()


def _stores(model: nn.Module) -> List[WeightGradStore]:
    return [m.wgrad_store for m in model.modules() if isinstance(getattr(m, "wgrad_store", None), WeightGradStore)]


def pending_wgrad(model: nn.Module) -> int:
    """How many recorded weight-gradient computations (``delay_wgrad``) wait in ``model``."""
    return sum(len(store) for store in _stores(model))


def backward_dw(model: nn.Module) -> int:
    """Run the weight-gradient work that layers built with ``delay_wgrad=True`` recorded during
    backward, accumulating into ``.grad`` (identical to the normal backward); returns how many
    computations ran. Collective under sequence parallelism and with replicated KV heads: call it on
    every rank of the TP group, before ``optimizer.step()`` and before clipping."""
    return sum(store.flush() for store in _stores(model))


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
        local = placements[name].shard(t, layer.tp.rank, layer.tp.size)
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
    if layer.tp.size == 1 or not named:
        return
    differ = ranks_that_differ(torch.stack([bit_hash(t) for _, t in named]), group=layer.tp)
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
    dense = nn.Linear(layer.in_features, layer.out_features, layer.bias is not None, device="meta")
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


def computes_linear(linear: nn.Linear) -> bool:
    """Whether an ``nn.Linear`` subclass with its own forward still computes ``x @ W.T + b`` (Falcon's
    ``FalconLinear`` spells it out by hand): probed in float64 with a small random weight of the same
    input width (the module's own weights are never copied), against ``F.linear``. Anything else (a
    scale, a quantized kernel, a forward that fails on the probe) is not."""
    gen = torch.Generator().manual_seed(0)
    width, rows = linear.in_features, min(linear.out_features, 8)
    probe = {"weight": torch.randn(rows, width, generator=gen, dtype=torch.float64)}
    if linear.bias is not None:
        probe["bias"] = torch.randn(rows, generator=gen, dtype=torch.float64)
    x = torch.randn(3, width, generator=gen, dtype=torch.float64)  # (n, in)
    try:
        with torch.no_grad():
            got = torch.func.functional_call(linear, probe, (x,), strict=False)
    except Exception:  # a kernel that cannot run on the probe is not plain linear
        return False
    want = torch.nn.functional.linear(x, probe["weight"], probe.get("bias"))
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def check_dense_linear(linear: nn.Module, cls: type) -> None:
    """Refuse anything but an ``nn.Linear`` (or a subclass computing the same) in ``cls.from_dense``."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{cls.__name__}.from_dense expects an nn.Linear, got {type(linear).__name__}")
    override = own_forward(linear, nn.Linear)
    if override is not None and not computes_linear(linear):
        raise TypeError(f"{cls.__name__}.from_dense: {type(linear).__name__} has its own forward "
                        f"({override}.forward); a plain TP layer would drop that behaviour")
