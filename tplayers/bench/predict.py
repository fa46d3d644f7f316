"""A PREDICTION of each mode's step on a named GPU, from one step recorded on any machine: ``tplayers bench --simulate
--predict h200``.

The step is recorded in the order the host issues it (:class:`StepTrace`): every kernel (an ATen op that launches
work, :data:`.counts.FREE` excluded) with its FLOPs and the bytes it reads and writes, every collective's launch and
the point its result is waited for, every host sync. Then it is replayed on a model of one GPU rank
(:func:`replay`), three clocks at once:

- the **host** issues each kernel in ``host_us`` and each collective in ``collective_host_us`` (Python, autograd
  and the launch itself); a host sync makes it wait for the device;
- the **compute stream** runs each kernel when both it and the host have reached it, for
  ``max(FLOPs / rate, bytes / memory bandwidth) + kernel_us`` (rate: ``gemm_tflops`` for matmuls,
  ``attention_tflops`` for attention, none for the rest: bandwidth-bound);
- the **link** runs each collective from the moment the compute stream reaches its launch (stream order) and the
  link is free (one link per rank, collectives in order), for the link model's alpha-beta time
  (:mod:`.link`); a wait holds the compute stream until that collective ends.

The step is when all three are done. No contention between the link and the compute (NCCL's kernels take SMs the
GEMMs then lack), no GEMM efficiency by shape beyond the per-kernel overhead, no caching effects: where the
prediction is off, those are the first suspects. Every figure it gives is labelled a prediction.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import contextlib

import torch
import torch.nn.functional as F

from ..core import collectives
from ..core.groups import TPGroup
from .counts import HOST_SYNCS, StepCounts, attention_op_flops, tensor_bytes
from .link import PRESETS, LinkModel, parse_link

__all__ = ["GPUModel", "GPUS", "StepTrace", "trace_step", "replay", "gpu_model", "prediction_link", "predict_modes"]


@dataclass(frozen=True)
class GPUModel:
    """One GPU as the prediction sees it. Rates are achieved ones (what large bf16 kernels reach), not peaks."""

    name: str
    gemm_tflops: float  # dense bf16 GEMMs
    attention_tflops: float  # fused attention (flash), forward and backward
    memory_gbps: float  # HBM, what a copy or an elementwise kernel reaches (read + write counted)
    kernel_us: float  # per kernel on the GPU: launch latency, tail, a small kernel's floor
    host_us: float  # host time to issue one op (eager PyTorch: Python, autograd, the launch)
    collective_host_us: float  # host time to issue one collective (tplayers' call, the backend's enqueue)


# Calibrated on the one GPU table there is (issue 52: H200, torch 2.11, simulated TP 8 Llama-3-8B layer, 4 x 2048
# tokens, bf16, the h100-nvlink link emulated on the GPU): the matmuls-alone step fixes the GEMM rate (580 of the
# 989 TFLOP/s bf16 peak); HBM at about 75% of the datasheet's (H100 SXM 3.35 TB/s, H200 4.8 TB/s); the host costs
# fit the schedules with many launches (collective matmul, batch chunks under sequence parallelism): eager
# PyTorch and tplayers' Python per op, and per collective the emulated link's CUDA bookkeeping (events, a sleep
# kernel, stream waits) as much as the collective's own call. benchmarks/RESULTS.md has the table and the errors.
GPUS: Dict[str, GPUModel] = {
    "h100": GPUModel("h100", gemm_tflops=580.0, attention_tflops=400.0, memory_gbps=2600.0, kernel_us=4.0,
                     host_us=40.0, collective_host_us=200.0),
    "h200": GPUModel("h200", gemm_tflops=580.0, attention_tflops=400.0, memory_gbps=3700.0, kernel_us=4.0,
                     host_us=40.0, collective_host_us=200.0),
}


def _causal(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether an attention op skips the masked half (CPU's flash op: ``is_causal`` is argument 4, 7 in backward)."""
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    index = 7 if name.endswith("backward") else 4
    return len(args) > index and isinstance(args[index], bool) and args[index]


class StepTrace(StepCounts):
    """A step's counts (:class:`.counts.StepCounts`) and its events in issue order: ``("kernel", name, flops, bytes,
    rate)`` (rate: "gemm", "attention" or None; bytes read and written), ``("launch", id, op, nbytes,
    group_size)``, ``("wait", id)`` (both from the collectives' observer), ``("sync",)``."""

    def __init__(self) -> None:
        super().__init__()
        self.events: List[Tuple[Any, ...]] = []

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Optional[Tuple[str, int, Optional[str]]]:
        kernel = super().record(func, args, kwargs, out)
        if func.overloadpacket.__name__ in HOST_SYNCS:
            self.events.append(("sync",))
        if kernel is not None:
            name, flops, rate = kernel
            if rate == "attention" and _causal(name, args, kwargs):
                flops //= 2
            nbytes = tensor_bytes(args) + tensor_bytes(list(kwargs.values())) + tensor_bytes(out)
            self.events.append(("kernel", name, flops, nbytes, rate))
        return kernel


class _Observer:
    """core.collectives' observer hook: each collective's launch and wait, into the trace."""

    def __init__(self, trace: StepTrace) -> None:
        self.trace, self.next = trace, 0

    def launch(self, op: str, nbytes: int, g: TPGroup, device: Optional[torch.device],
               call: Callable[[], Any]) -> Tuple[Any, Any]:
        # (the fake group has no point-to-point on the meta device; nothing would move anyway: a ring step's
        # works as batch_isend_irecv returns them, none)
        work = [] if op == "send" and device is not None and device.type == "meta" else call()
        token, self.next = self.next, self.next + 1
        self.trace.events.append(("launch", token, op, nbytes, g.size))
        if work is None:  # a blocking collective: waited for at its launch
            self.trace.events.append(("wait", token))
        return work, token

    def finished(self, token: Any, wait_started: float) -> None:
        self.trace.events.append(("wait", token))


class _MetaAttention(torch.autograd.Function):
    """Scaled dot-product attention on the meta device as a GPU runs it: one fused kernel each way (flash attention),
    where the meta device would decompose it into matmuls and a softmax over the whole (s, t) score matrix."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, events: List[Tuple[Any, ...]]):
        flops = attention_op_flops("flash_attention", (q, k)) // (2 if causal else 1)
        nbytes = tensor_bytes((q, k, v, q))  # (out: q's size, d_v = d)
        events.append(("kernel", "flash_attention", flops, nbytes, "attention"))
        ctx.flops, ctx.nbytes, ctx.events = flops, nbytes, events
        return q.new_empty(q.shape[:-1] + v.shape[-1:])

    @staticmethod
    def backward(ctx, grad):
        q_shape = grad.shape  # (the gradients' shapes are what the meta device carries)
        ctx.events.append(("kernel", "flash_attention_backward", 2 * ctx.flops, 2 * ctx.nbytes, "attention"))
        return grad.new_empty(q_shape), None, None, None, None


class _MetaRMSNorm(torch.autograd.Function):
    """RMSNorm on the meta device as a GPU runs it: one fused kernel each way (torch's ``_fused_rms_norm`` on CUDA),
    where the meta device decomposes it into a dozen float32 elementwise kernels."""

    @staticmethod
    def forward(ctx, x, weight, events: List[Tuple[Any, ...]]):
        ctx.nbytes, ctx.events, ctx.has_weight = tensor_bytes(x), events, weight is not None
        events.append(("kernel", "fused_rms_norm", 0, 2 * ctx.nbytes + tensor_bytes(weight), None))
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx, grad):
        ctx.events.append(("kernel", "fused_rms_norm_backward", 0, 3 * ctx.nbytes, None))
        return grad.new_empty(grad.shape), (grad.new_empty(grad.shape[-1:]) if ctx.has_weight else None), None


@contextlib.contextmanager
def _fused_on_meta(events: List[Tuple[Any, ...]]) -> Iterator[None]:
    """While tracing on the meta device, the fused kernels a GPU runs where the meta device decomposes:
    ``F.scaled_dot_product_attention`` (:class:`_MetaAttention`) and ``F.rms_norm`` (:class:`_MetaRMSNorm`), for
    meta tensors only. Replaced in ``torch.nn.functional`` for the step (a torch-function mode would not see the
    calls a custom Function's backward makes: autograd runs backward without those modes)."""
    sdpa, rms_norm = F.scaled_dot_product_attention, F.rms_norm

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        if q.device.type == "meta" and attn_mask is None and q.shape[1] == k.shape[1] and not kwargs:
            return _MetaAttention.apply(q, k, v, bool(is_causal), events)
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    def norm(x, normalized_shape, weight=None, eps=None):
        if x.device.type == "meta":
            return _MetaRMSNorm.apply(x, weight, events)
        return rms_norm(x, normalized_shape, weight, eps)

    F.scaled_dot_product_attention, F.rms_norm = attention, norm
    try:
        yield
    finally:
        F.scaled_dot_product_attention, F.rms_norm = sdpa, rms_norm


def trace_step(step: Callable[[], None]) -> Tuple[List[Tuple[Any, ...]], Dict[str, Any]]:
    """One run of ``step`` (after its warm-up) recorded: its :class:`StepTrace` events and its counts
    (:class:`.counts.StepCounts`, of the same run)."""
    trace = StepTrace()
    previous = collectives.set_observer(_Observer(trace))
    try:
        with _fused_on_meta(trace.events), trace:
            step()
    finally:
        collectives.set_observer(previous)
    return trace.events, trace.as_dict()


def replay(events: List[Tuple[Any, ...]], gpu: GPUModel, link: LinkModel) -> Dict[str, float]:
    """The predicted step (ms) of ``events`` on ``gpu`` and ``link``, and where its time went (see the module
    docstring): ``step_ms``, ``kernels_ms`` (the compute stream busy), ``gemm_ms``, ``attention_ms``, ``memory_ms``
    (bandwidth-bound kernels), ``overhead_ms`` (per-kernel floors), ``link_ms`` (collectives on the link),
    ``host_ms`` (issuing), ``stream_waits_ms`` (the compute stream held by a wait), ``host_bound_ms`` (the
    compute stream idle for want of issued work)."""
    host = gpu_t = link_free = 0.0
    ends: Dict[Any, float] = {}
    parts = dict(gemm_ms=0.0, attention_ms=0.0, memory_ms=0.0, overhead_ms=0.0, link_ms=0.0, stream_waits_ms=0.0,
                 host_bound_ms=0.0)
    rates = {"gemm": gpu.gemm_tflops * 1e12, "attention": gpu.attention_tflops * 1e12}
    for event in events:
        kind = event[0]
        if kind == "kernel":
            _, _, flops, nbytes, rate = event
            host += gpu.host_us * 1e-6
            if host > gpu_t:
                parts["host_bound_ms"] += (host - gpu_t) * 1e3
                gpu_t = host
            compute = flops / rates[rate] if rate else 0.0
            memory = nbytes / (gpu.memory_gbps * 1e9)
            busy = max(compute, memory)
            parts[f"{rate}_ms" if rate and compute >= memory else "memory_ms"] += busy * 1e3
            parts["overhead_ms"] += gpu.kernel_us * 1e-3
            gpu_t += busy + gpu.kernel_us * 1e-6
        elif kind == "launch":
            _, token, op, nbytes, size = event
            host += gpu.collective_host_us * 1e-6
            start = max(gpu_t, host, link_free)
            duration = link.seconds(op, nbytes, size)
            ends[token] = link_free = start + duration
            parts["link_ms"] += duration * 1e3
        elif kind == "wait":
            end = ends.pop(event[1], 0.0)
            if end > gpu_t:
                parts["stream_waits_ms"] += (end - gpu_t) * 1e3
                gpu_t = end
        elif kind == "sync":
            host = max(host, gpu_t)
    step = max(host, gpu_t, link_free)
    kernels = sum(parts[k] for k in ("gemm_ms", "attention_ms", "memory_ms", "overhead_ms"))
    return {"step_ms": step * 1e3, "kernels_ms": kernels, "host_ms": host * 1e3, **parts}


def gpu_model(name: str) -> GPUModel:
    """The GPU of ``--predict NAME``; a ValueError naming the choices otherwise."""
    if name not in GPUS:
        raise ValueError(f"bench: --predict {name!r}: choose one of {sorted(GPUS)}")
    return GPUS[name]


def prediction_link(spec: str) -> LinkModel:
    """The GPU node's link a spec stands for: ``match:PRESET[@TFLOPS]`` (a link scaled to this machine's
    compute) is the preset itself; anything else as parsed."""
    text = spec.strip()
    if text.startswith("match:"):
        return PRESETS[text[len("match:"):].partition("@")[0]]
    return parse_link(text)


def predict_modes(steps: Dict[str, Callable[[], None]], gpu: GPUModel, link: LinkModel) -> Dict[str, Any]:
    """Each mode's predicted step (:func:`replay` of one recorded steady-state step, after one warm-up step), its
    ratio to the predicted limit max(matmuls alone, collectives alone) when both are among ``steps``, the model used
    and each mode's counts (``counts``)."""
    modes, counts = {}, {}
    for name, step in steps.items():
        trace_step(step)  # warm-up: what a first step sets up once is not part of the steady state
        events, counts[name] = trace_step(step)
        modes[name] = replay(events, gpu, link)
    out: Dict[str, Any] = {"gpu": {**asdict(gpu), "note": "PREDICTION: a model of one GPU rank replaying one "
                                                        "recorded step (tplayers.bench.predict); not measured"},
                           "link": {"bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us},
                           "modes": modes, "counts": counts}
    if "compute" in modes and "comm" in modes:
        limit = max(modes["compute"]["step_ms"], modes["comm"]["step_ms"])
        out["limit_ms"] = limit
        for m in modes.values():
            m["vs_limit"] = m["step_ms"] / limit
    return out
