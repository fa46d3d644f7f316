"""Verify TP modules the way tplayers verifies itself.

`World` is a persistent set of spawned ranks (gloo on loopback by default) that runs a
module-level function on every rank and returns the per-rank results. It is started once and
reused across tests and hypothesis examples. A failure, timeout or crash on any rank fails the
call with that rank's traceback, and the world is torn down and rebuilt on the next call:
nothing ever waits on a rank that is gone.

`assert_matches_dense` runs on every rank (inside `World.run` or under torchrun) and checks a
TP module against the dense module it was built from: outputs, input gradients and gathered
parameter gradients.

    def check(group, seed):
        torch.manual_seed(seed)
        dense = nn.Linear(16, 32, dtype=torch.float64)
        tp = ColumnParallelLinear.from_dense(dense, group=group, gather_output=True)
        return assert_matches_dense(tp, dense, torch.randn(4, 16, dtype=torch.float64), group=group)

    with World(2) as world:
        reports = world.run(check, seed=0)   # one MatchReport per rank
"""
from __future__ import annotations

import atexit
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core.comm import all_gather_tensor
from ..core.groups import GroupLike, resolve_group
from ..layers.base import TensorParallelModule

__all__ = [
    "World",
    "FORKSERVER_PRELOAD",
    "WorldError",
    "RankFailed",
    "WorldTimeout",
    "get_world",
    "shutdown_worlds",
    "assert_matches_dense",
    "MatchReport",
    "dense_parameters",
    "default_tolerance",
]


# ---------------------------------------------------------------------------- the rank world


class WorldError(RuntimeError):
    """A call on the world failed; the world has been torn down and will be rebuilt."""


class RankFailed(WorldError):
    """A rank raised. ``rank`` and ``remote_traceback`` say where and why."""

    def __init__(self, rank: int, remote_traceback: str, others: Dict[int, str]) -> None:
        self.rank, self.remote_traceback, self.others = rank, remote_traceback, others
        extra = f" (ranks {sorted(others)} failed too)" if others else ""
        super().__init__(f"rank {rank} failed{extra}:\n{remote_traceback}")


class WorldTimeout(WorldError):
    """Some ranks did not answer in time (hung collective, dead peer)."""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists. (Not ``os.getppid() == pid``: a rank forked from the
    forkserver has the server, not the process that owns the world, as its parent.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _worker_main(rank: int, size: int, backend: str, init_file: str, conn: Any,
                 collective_timeout_s: float, threads: int, parent_pid: int) -> None:
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=collective_timeout_s))
        conn.send_bytes(pickle.dumps(("ready", None)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    group = dist.group.WORLD
    while True:
        if not conn.poll(1.0):
            if not _alive(parent_pid):  # orphaned: the parent died without closing us
                break
            continue
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not data:
            break
        try:
            fn, args, kwargs = pickle.loads(data)
            payload: Tuple[str, Any] = ("ok", fn(group, *args, **kwargs))
        except BaseException:
            payload = ("error", traceback.format_exc())
        try:
            out = pickle.dumps(payload)
        except Exception:
            out = pickle.dumps(("error", f"the result could not be pickled:\n{traceback.format_exc()}"))
        conn.send_bytes(out)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


#: Modules the rank-forking server imports once, so a (re)started rank has them for free.
#: Extend it before the first world starts with whatever your rank functions import (a test
#: suite adds its test modules' heavy imports, e.g. "hypothesis", "pytest").
FORKSERVER_PRELOAD: List[str] = [
    "torch", "torch.distributed", "tplayers",
    "torch.distributed.tensor",  # torch.testing.assert_close imports it lazily: 2-3 s per fresh rank
]


def _context() -> Any:
    """Fork ranks from a server that has already imported torch (a rank starts in well under a
    second, so rebuilding a world after a failure is cheap); spawn where forkserver is missing."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        return ctx
    return mp.get_context("spawn")


class World:
    """N spawned ranks in one process group, reused across calls.

    ``run(fn, *args, **kwargs)`` calls ``fn(group, *args, **kwargs)`` on every rank, where
    ``group`` is the world's ProcessGroup, and returns the results in rank order. ``fn`` must
    be importable (a module-level function) and its arguments and results picklable.
    """

    def __init__(self, size: int, *, backend: str = "gloo", timeout: float = 120.0,
                 collective_timeout: float = 60.0, start_timeout: float = 180.0, threads: int = 1) -> None:
        if size < 1:
            raise ValueError(f"World size must be >= 1, got {size}")
        self.size, self.backend, self.timeout = size, backend, timeout
        self.collective_timeout, self.start_timeout, self.threads = collective_timeout, start_timeout, threads
        self._procs: List[Any] = []
        self._conns: List[Any] = []
        self._tmpdir: Optional[tempfile.TemporaryDirectory] = None
        self.starts = 0  # how many times the ranks were (re)started

    # -- lifecycle
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> "World":
        if self.alive:
            return self
        self.close()
        ctx = _context()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="tplayers-world-")
        init_file = os.path.join(self._tmpdir.name, "rendezvous")
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, daemon=True, name=f"tplayers-rank{rank}",
                            args=(rank, self.size, self.backend, init_file, child,
                                  self.collective_timeout, self.threads, os.getpid()))
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self.starts += 1
        self._collect(self.start_timeout, what="start")
        return self

    def close(self, *, force: bool = False) -> None:
        """Stop every rank: politely (they leave the process group), or at once with ``force``."""
        if not force:
            for c in self._conns:
                try:
                    c.send_bytes(b"")
                except Exception:
                    pass
        deadline = time.monotonic() + (0 if force else 5)
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> "World":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- calls
    def run(self, fn: Callable[..., Any], *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> List[Any]:
        """``fn(group, *args, **kwargs)`` on every rank; the results, in rank order."""
        try:
            data = pickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(
                f"World.run needs a module-level function and picklable arguments: {e}"
            ) from e
        self.start()
        for c in self._conns:
            c.send_bytes(data)
        return self._collect(self.timeout if timeout is None else timeout, what=getattr(fn, "__qualname__", "call"))

    def _collect(self, timeout: float, what: str) -> List[Any]:
        results: List[Any] = [None] * self.size
        errors: Dict[int, str] = {}
        pending = set(range(self.size))
        deadline = time.monotonic() + timeout
        grace_deadline: Optional[float] = None  # after the first failure, peers get a moment to report
        while pending:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            ready = mpc.wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                             timeout=min(1.0, limit - now))
            for r in list(pending):
                conn, proc = self._conns[r], self._procs[r]
                if conn in ready or conn.poll():
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        status, value = "error", f"rank {r} closed its pipe (exit code {proc.exitcode})"
                elif proc.sentinel in ready or not proc.is_alive():
                    proc.join(timeout=1)
                    status, value = "error", f"rank {r} died (exit code {proc.exitcode}) during {what}"
                else:
                    continue
                pending.discard(r)
                if status == "ok" or status == "ready":
                    results[r] = value
                else:
                    errors[r] = value
                    if grace_deadline is None:
                        grace_deadline = time.monotonic() + 2.0
        if errors or pending:
            self.close(force=True)  # a half-finished collective poisons the group: rebuild on the next call
            if errors:
                first = next(iter(errors))  # the earliest report: later ones are usually its echoes
                raise RankFailed(first, errors[first], {r: t for r, t in errors.items() if r != first})
            raise WorldTimeout(f"ranks {sorted(pending)} of {self.size} did not finish {what} within {timeout:.0f}s")
        return results


_WORLDS: Dict[Tuple[int, str], World] = {}


def get_world(size: int, backend: str = "gloo", **options: Any) -> World:
    """The process-wide persistent world of ``size`` ranks (started on first use)."""
    key = (size, backend)
    if key not in _WORLDS:
        _WORLDS[key] = World(size, backend=backend, **options)
    return _WORLDS[key]


@atexit.register
def shutdown_worlds() -> None:
    """Stop every world `get_world` started."""
    for w in _WORLDS.values():
        w.close()
    _WORLDS.clear()


# ---------------------------------------------------------------------------- dense comparison


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


def _dense_of_grads(module: TensorParallelModule) -> nn.Module:
    """``module.to_dense()`` computed on the gradients instead of the parameters."""
    params = list(module.parameters())
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        return module.to_dense()
    finally:
        for p, d in zip(params, saved):
            p.data = d


def dense_parameters(module: nn.Module, *, grads: bool = False) -> Dict[str, torch.Tensor]:
    """Every parameter (or its gradient) of ``module`` as the dense model would name and shape it.

    TP submodules are gathered with their ``to_dense()`` (collective: call on every rank);
    ordinary parameters are taken as they are.
    """
    if isinstance(module, TensorParallelModule):
        dense = _dense_of_grads(module) if grads else module.to_dense()
        return {n: p.detach() for n, p in dense.named_parameters()}
    out: Dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(recurse=False):
        value = p.grad if grads else p
        out[name] = (torch.zeros_like(p) if value is None else value).detach()
    for child_name, child in module.named_children():
        for name, t in dense_parameters(child, grads=grads).items():
            out[f"{child_name}.{name}"] = t
    return out


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
    parameter gradient (TP ones gathered with ``to_dense``) after backpropagating the same
    random output gradient through both. Raises AssertionError naming the first mismatch.
    """
    g = resolve_group(group)
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    shard_dims = list(input_shard_dims) if input_shard_dims is not None else [None] * len(inputs)
    if len(shard_dims) != len(inputs):
        raise ValueError(f"input_shard_dims has {len(shard_dims)} entries for {len(inputs)} inputs")

    def leaf(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        return t.requires_grad_(t.is_floating_point())

    dense_in = [leaf(t) for t in inputs]
    tp_in = [leaf(t if d is None else g.shard(t, d, what=f"input {i}")) for i, (t, d) in enumerate(zip(inputs, shard_dims))]
    dense_module.zero_grad(set_to_none=True)
    tp_module.zero_grad(set_to_none=True)

    dense_out = dense_module(*dense_in)
    tp_out = tp_module(*tp_in)
    if not isinstance(dense_out, torch.Tensor) or not isinstance(tp_out, torch.Tensor):
        raise TypeError("assert_matches_dense compares modules that return one tensor")
    tp_full = tp_out if output_shard_dim is None else all_gather_tensor(tp_out, output_shard_dim, group=g)
    d_rtol, d_atol = default_tolerance(dense_out.dtype)
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol

    # A mismatch is raised only after every collective below: it may show on some ranks only
    # (a replicated output), and a rank leaving early would leave the others waiting.
    failures: List[str] = []

    def compare(name: str, actual: torch.Tensor, expected: torch.Tensor) -> float:
        err, failure = _compare(name, actual, expected, rtol, atol, g.rank)
        if failure is not None:
            failures.append(failure)
        return err

    report = MatchReport()
    report.output_error = compare("output", tp_full, dense_out)
    report.errors["output"] = report.output_error

    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(dense_out.shape, generator=gen, dtype=torch.float64).to(dense_out.dtype).to(dense_out.device)
    dense_out.backward(grad_out)
    tp_grad = grad_out if output_shard_dim is None else g.shard(grad_out, output_shard_dim).contiguous()
    tp_out.backward(tp_grad)

    for i, (d_in, t_in, dim) in enumerate(zip(dense_in, tp_in, shard_dims)):
        if not d_in.requires_grad:
            continue
        expected = d_in.grad if d_in.grad is not None else torch.zeros_like(d_in)
        actual = t_in.grad if t_in.grad is not None else torch.zeros_like(t_in)
        if dim is not None:
            actual = all_gather_tensor(actual, dim, group=g)
        err = compare(f"gradient of input {i}", actual, expected)
        report.errors[f"input{i}.grad"] = err
        report.input_grad_error = max(report.input_grad_error, err)

    tp_grads = dense_parameters(tp_module, grads=True)
    dense_grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in dense_module.named_parameters()}
    if set(tp_grads) != set(dense_grads):
        raise AssertionError(
            f"rank {g.rank}: parameter names differ: only in TP {sorted(set(tp_grads) - set(dense_grads))}, "
            f"only in dense {sorted(set(dense_grads) - set(tp_grads))}"
        )
    for name in sorted(dense_grads):
        err = compare(f"gradient of parameter '{name}'", tp_grads[name], dense_grads[name])
        report.errors[f"{name}.grad"] = err
        report.param_grad_error = max(report.param_grad_error, err)
    if failures:
        raise AssertionError(failures[0])
    return report
