"""`assert_matches_dense`: check, on every rank, that a TP module computes what its dense module computes.

Runs inside `tplayers.testing.World.run` or under torchrun: outputs, input gradients and every
parameter gradient (sharded ones gathered through their placement).

    def check(group, seed):
        torch.manual_seed(seed)
        dense = nn.Linear(16, 32, dtype=torch.float64)
        tp = ColumnParallelLinear.from_dense(dense, group=group, gather_output=True)
        return assert_matches_dense(tp, dense, torch.randn(4, 16, dtype=torch.float64), group=group)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ..core.blocking import all_gather_tensor
from ..core.groups import GroupLike, resolve_group
from ..layers.switches import backward_dw, main_grads_to_grads, zero_main_grads
from ..layers.dense_view import dense_parameters

__all__ = ["assert_matches_dense", "MatchReport", "dense_parameters", "default_tolerance"]


def default_tolerance(dtype: torch.dtype) -> Tuple[float, float]:
    """(rtol, atol) for comparing a TP result with its dense reference.

    TP changes only the order of the sums, so float64 matches to ~1e-12; low precision is
    bounded by its rounding of the partial sums.
    """
    return {
        torch.float64: (1e-9, 1e-9),
        torch.float32: (1e-4, 1e-5),
        torch.bfloat16: (2e-2, 2e-2),
        torch.float16: (5e-3, 1e-3),
    }.get(dtype, (1e-4, 1e-5))


@dataclass
class MatchReport:
    """Largest absolute differences found, by what was compared (per rank)."""

    output_error: float = 0.0
    input_grad_error: float = 0.0
    param_grad_error: float = 0.0
    errors: Dict[str, float] = field(default_factory=dict)

    @property
    def grad_error(self) -> float:
        return max(self.input_grad_error, self.param_grad_error)


def _compare(name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float,
             rank: int) -> Tuple[float, Optional[str]]:
    """(max abs error, None) when within tolerance, else (max abs error, what differs)."""
    if actual.shape != expected.shape:
        return math.inf, f"rank {rank}: {name} has shape {tuple(actual.shape)}, dense has {tuple(expected.shape)}"
    a, e = actual.detach().to(torch.float64).cpu(), expected.detach().to(torch.float64).cpu()
    err = (a - e).abs()
    max_err = float(err.nan_to_num(nan=float("inf")).max()) if err.numel() else 0.0
    bad = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)  # a NaN only matches a NaN
    if bool(bad.any()):
        return max_err, (f"rank {rank}: {name} differs from the dense reference: max abs error {max_err:.3e}, "
                         f"{int(bad.sum())} of {bad.numel()} elements outside atol={atol:g} rtol={rtol:g}")
    return max_err, None


def assert_matches_dense(
    tp_module: nn.Module,
    dense_module: nn.Module,
    inputs: Union[torch.Tensor, Sequence[torch.Tensor]],
    *,
    group: GroupLike,
    input_shard_dims: Optional[Sequence[Optional[int]]] = None,
    output_shard_dim: Optional[int] = None,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    seed: int = 0,
) -> MatchReport:
    """Check on every rank that ``tp_module`` computes what ``dense_module`` computes.

    ``inputs`` are the full dense inputs, identical on every rank. ``input_shard_dims[i]`` says
    how the TP module takes input i: None (the full tensor) or a dim (this rank's chunk of it).
    ``output_shard_dim`` is None when the TP output is already full, or the dim its shards are
    gathered along. Compares the output, the gradient of every floating input, and every
    parameter gradient (sharded ones gathered through their placement) after backpropagating the same
    random output gradient through both (running ``backward_dw`` for layers that delay their weight
    gradients; ``main_grad`` buffers are zeroed first and compared as the gradient). Raises
    AssertionError naming the first mismatch.

    In bfloat16 / float16 the dense result is itself rounded: where terms of opposite sign cancel (a tied weight's
    two gradients) its elements can be far, relatively, from the exact value, and TP's differently. A tensor outside
    the elementwise tolerance then passes if TP is at most twice as far from the float64 truth (the dense module run
    in float64 on the same inputs, a copy) as dense is: as accurate as dense, not equal to its rounding.
    """
    g = resolve_group(group)
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    shard_dims = list(input_shard_dims) if input_shard_dims is not None else [None] * len(inputs)
    if len(shard_dims) != len(inputs):
        raise ValueError(f"input_shard_dims has {len(shard_dims)} entries for {len(inputs)} inputs")
    dense_in = [_leaf(t) for t in inputs]
    tp_in = [_leaf(t if d is None else g.shard(t, d, what=f"input {i}")) for i, (t, d) in enumerate(zip(inputs, shard_dims))]
    dense_module.zero_grad(set_to_none=True)
    tp_module.zero_grad(set_to_none=True)
    zero_main_grads(tp_module)  # layers with use_main_grad: their float32 buffers
    dense_out, tp_out = dense_module(*dense_in), tp_module(*tp_in)
    if not isinstance(dense_out, torch.Tensor) or not isinstance(tp_out, torch.Tensor):
        raise TypeError("assert_matches_dense compares modules that return one tensor")
    d_rtol, d_atol = default_tolerance(dense_out.dtype)
    # A mismatch is raised only after every collective below: it may show on some ranks only
    # (a replicated output), and a rank leaving early would leave the others waiting.
    check = _Checker(g.rank, d_rtol if rtol is None else rtol, d_atol if atol is None else atol)
    check.low_precision = dense_out.dtype in LOW_PRECISION
    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(dense_out.shape, generator=gen, dtype=torch.float64).to(dense_out.dtype).to(dense_out.device)
    report = MatchReport()
    tp_full = tp_out if output_shard_dim is None else all_gather_tensor(tp_out, output_shard_dim, group=g)
    report.output_error = report.errors["output"] = check("output", tp_full, dense_out, "output")

    dense_out.backward(grad_out)
    tp_out.backward(grad_out if output_shard_dim is None else g.shard(grad_out, output_shard_dim).contiguous())
    backward_dw(tp_module)  # layers with delay_wgrad=True: their recorded weight gradients, now
    main_grads_to_grads(tp_module)  # and main_grad buffers, compared as .grad

    for i, (d_in, t_in, dim) in enumerate(zip(dense_in, tp_in, shard_dims)):
        if d_in.requires_grad:
            actual = _grad_or_zeros(t_in)
            actual = actual if dim is None else all_gather_tensor(actual, dim, group=g)
            err = report.errors[f"input{i}.grad"] = check(f"gradient of input {i}", actual, _grad_or_zeros(d_in),
                                                          f"input{i}.grad")
            report.input_grad_error = max(report.input_grad_error, err)
    _compare_param_grads(tp_module, dense_module, check, report, g.rank)
    if check.pending:  # low precision, outside the elementwise tolerance: judged against the float64 truth (local)
        check.judge(_float64_truth(dense_module, dense_in, grad_out))
    if check.failures:
        raise AssertionError(check.failures[0])
    return report


LOW_PRECISION = (torch.bfloat16, torch.float16)


def _float64_truth(dense_module: nn.Module, dense_in: Sequence[torch.Tensor], grad_out: torch.Tensor
                   ) -> Dict[str, torch.Tensor]:
    """What a float64 copy of ``dense_module`` computes on the same inputs: ``{"output", "input{i}.grad",
    "<param>.grad"}``, the names `_Checker` compares under."""
    import copy

    ref = copy.deepcopy(dense_module).to(torch.float64)
    ref.zero_grad(set_to_none=True)
    ins = [_leaf(t.detach().to(torch.float64) if t.is_floating_point() else t) for t in dense_in]
    with torch.random.fork_rng(devices=[grad_out.device] if grad_out.is_cuda else []):  # (the caller's stream kept)
        out = ref(*ins)
        out.backward(grad_out.to(torch.float64))
    truth = {"output": out.detach()}
    truth.update({f"input{i}.grad": _grad_or_zeros(t) for i, t in enumerate(ins) if t.requires_grad})
    truth.update({f"{n}.grad": _grad_or_zeros(p) for n, p in ref.named_parameters()})
    return truth


def _leaf(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    return t.requires_grad_(t.is_floating_point())


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


class _Checker:
    """Compares and records failures instead of raising (see the note in assert_matches_dense)."""

    def __init__(self, rank: int, rtol: float, atol: float) -> None:
        self.rank, self.rtol, self.atol, self.failures = rank, rtol, atol, []
        self.low_precision = False
        self.pending: Dict[str, Tuple[str, torch.Tensor, torch.Tensor]] = {}  # low precision: judged by the truth

    def __call__(self, name: str, actual: torch.Tensor, expected: torch.Tensor, key: str = "") -> float:
        err, failure = _compare(name, actual, expected, self.rtol, self.atol, self.rank)
        if failure is not None and self.low_precision and key:
            self.pending[key] = (failure, actual.detach(), expected.detach())
        elif failure is not None:
            self.failures.append(failure)
        return err

    def judge(self, truth: Dict[str, torch.Tensor]) -> None:
        """Each pending tensor passes when its largest error against ``truth`` is at most twice dense's."""
        for key, (failure, actual, expected) in self.pending.items():
            exact = truth.get(key)
            if exact is not None and exact.shape == actual.shape:
                mine, dense = (float((t.to(torch.float64).cpu() - exact.cpu()).abs().max()) for t in (actual, expected))
                if math.isfinite(dense) and mine <= 2 * dense:  # as accurate as dense: its rounding, not a fault
                    continue
                failure += (f"; against the float64 truth its max abs error is {mine:.3e}, dense's {dense:.3e} "
                            "(allowed: twice dense's)")
            self.failures.append(failure)
        self.pending = {}


def _compare_param_grads(tp_module: nn.Module, dense_module: nn.Module, check: _Checker, report: MatchReport,
                         rank: int) -> None:
    """Every parameter gradient of the TP module (gathered to dense form) against the dense one."""
    tp_grads = dense_parameters(tp_module, grads=True)
    dense_grads = {n: _grad_or_zeros(p) for n, p in dense_module.named_parameters()}
    if set(tp_grads) != set(dense_grads):
        raise AssertionError(
            f"rank {rank}: parameter names differ: only in TP {sorted(set(tp_grads) - set(dense_grads))}, "
            f"only in dense {sorted(set(dense_grads) - set(tp_grads))}"
        )
    for name in sorted(dense_grads):
        err = report.errors[f"{name}.grad"] = check(f"gradient of parameter '{name}'", tp_grads[name],
                                                    dense_grads[name], f"{name}.grad")
        report.param_grad_error = max(report.param_grad_error, err)
