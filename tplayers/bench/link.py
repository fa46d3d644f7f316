"""An interconnect model for emulation: alpha-beta time of each collective on a named link.

``LinkModel(bandwidth_gbps, latency_us)`` gives the modeled duration of a collective on ``p`` ranks
moving a buffer of ``n`` bytes (``n``: the all-reduce buffer, the all-gather OUTPUT, the
reduce-scatter INPUT, i.e. always the full tensor), with ``B`` the per-direction bandwidth of one
rank's link and ``a`` the latency of one step:

    all-reduce (ring)           2 (p-1)/p * n/B + 2 (p-1) a
    all-gather, reduce-scatter    (p-1)/p * n/B +   (p-1) a
    broadcast, send/recv                    n/B +         a

the textbook ring costs (Thakur, Rabenseifner, Gropp 2005; NCCL's "bus bandwidth" convention).

Presets (per direction, per GPU; latencies are modelling assumptions, not vendor figures):

- ``h100-nvlink``: NVLink 4 on H100 SXM, 900 GB/s bidirectional = 450 GB/s per direction
  (NVIDIA H100 datasheet); 3 us per step.
- ``pcie5``: PCIe Gen5 x16, 64 GB/s per direction (PCI-SIG: 32 GT/s x 16 lanes, 128b/130b); 5 us.
- ``ib-ndr``: InfiniBand NDR, 400 Gb/s = 50 GB/s per direction per port (NVIDIA ConnectX-7); 5 us.

A spec string: a preset name, ``GBPS[/LATENCY_US]`` (``"0.05/20"``: 50 MB/s, 20 us),
``match:PRESET``: the preset's bandwidth scaled by (this machine's measured float32 matmul
throughput / the H100's dense bf16 peak, 989 TFLOP/s), so that a CPU run keeps a GPU node's
compute-to-communication ratio (measured at the start of each run: it moves with the machine's
load), or ``match:PRESET@TFLOPS``: the same scaling for a STATED throughput, measured nothing (the
same link on every run). ``DEFAULT_CPU_LINK`` (what ``tplayers bench`` uses on CPU unless told
otherwise) is ``match:h100-nvlink@REFERENCE_TFLOPS``: an H100 node's NVLink for a CPU rank of
``REFERENCE_TFLOPS`` (see `REFERENCE`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import torch

__all__ = ["LinkModel", "PRESETS", "GPU_PEAK_TFLOPS", "REFERENCE_TFLOPS", "REFERENCE", "DEFAULT_CPU_LINK",
           "parse_link", "matmul_tflops", "calibration"]


@dataclass(frozen=True)
class LinkModel:
    """Per-direction bandwidth (GB/s, 1e9 bytes) and per-step latency (microseconds) of one rank's link."""

    bandwidth_gbps: float
    latency_us: float = 0.0
    spec: str = ""  # what the user wrote, for reports
    preset: Optional[str] = None  # match:PRESET: the preset it was scaled from
    scaled_for_tflops: Optional[float] = None  # match:: the compute throughput the bandwidth was scaled for
    measured: bool = False  # match:PRESET (no @): that throughput was measured on this machine, this run

    def __post_init__(self) -> None:
        if not (self.bandwidth_gbps > 0 and self.bandwidth_gbps < float("inf")):
            raise ValueError(f"link: bandwidth must be a positive number of GB/s, got {self.bandwidth_gbps}")
        if not (0 <= self.latency_us < float("inf")):
            raise ValueError(f"link: latency must be >= 0 microseconds, got {self.latency_us}")

    def seconds(self, op: str, nbytes: int, group_size: int) -> float:
        """Modeled duration of ``op`` over ``group_size`` ranks on a full buffer of ``nbytes``."""
        p, a, per_byte = group_size, self.latency_us * 1e-6, 1.0 / (self.bandwidth_gbps * 1e9)
        if p <= 1:
            return 0.0
        if op == "all_reduce":
            return 2 * (p - 1) / p * nbytes * per_byte + 2 * (p - 1) * a
        if op == "all_to_all":  # nbytes: what this rank sends to the others
            return nbytes * per_byte + (p - 1) * a
        if op in ("all_gather", "reduce_scatter"):
            return (p - 1) / p * nbytes * per_byte + (p - 1) * a
        if op in ("broadcast", "send", "recv"):
            return nbytes * per_byte + a
        raise ValueError(f"link: no model for collective {op!r}")


PRESETS: Dict[str, LinkModel] = {
    "h100-nvlink": LinkModel(450.0, 3.0, "h100-nvlink"),
    "pcie5": LinkModel(64.0, 5.0, "pcie5"),
    "ib-ndr": LinkModel(50.0, 5.0, "ib-ndr"),
}

GPU_PEAK_TFLOPS = {"h100": 989.0}  # dense bf16 tensor-core peak, H100 SXM datasheet

# The reference CPU rank of the default emulated link: one thread of float32 matmul at this throughput.
REFERENCE_TFLOPS = 0.1
REFERENCE = ("one CPU thread of float32 matmul at 0.1 TFLOP/s (the project's 2-core AMD EPYC box, idle: "
             "0.099 TFLOP/s, benchmarks/RESULTS.md, 2026-11-22), standing for an H100's 989 TFLOP/s")
DEFAULT_CPU_LINK = f"match:h100-nvlink@{REFERENCE_TFLOPS:g}"


def matmul_tflops(size: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """This process's measured matmul throughput (TFLOP/s): the best of ``repeats`` square matmuls."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best / 1e12


def parse_link(spec: Union[str, LinkModel], *, tflops: Optional[float] = None) -> LinkModel:
    """A `LinkModel` from a preset name, ``GBPS[/LATENCY_US]`` or ``match:PRESET`` (``tflops``: this
    machine's matmul throughput for ``match:``, measured when not given)."""
    if isinstance(spec, LinkModel):
        return spec
    text = spec.strip()
    if text in PRESETS:
        return PRESETS[text]
    if text.startswith("match:"):
        name, at, stated = text[len("match:"):].partition("@")
        base = PRESETS.get(name)
        if base is None:
            raise ValueError(f"link {spec!r}: match: needs a preset ({', '.join(PRESETS)})")
        if at:
            try:
                fixed = float(stated)
            except ValueError:
                fixed = -1.0
            if not (0 < fixed < float("inf")):
                raise ValueError(f"link {spec!r}: match:PRESET@TFLOPS needs a positive TFLOP/s after '@'")
            throughput, measured = fixed, False
        else:
            throughput, measured = (tflops if tflops is not None else matmul_tflops()), True
        scale = throughput / GPU_PEAK_TFLOPS["h100"]
        return LinkModel(base.bandwidth_gbps * scale, base.latency_us, text, preset=name,
                         scaled_for_tflops=throughput, measured=measured)
    try:
        parts = [float(x) for x in text.split("/")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2):
        raise ValueError(f"link {spec!r}: expected a preset ({', '.join(PRESETS)}), GBPS[/LATENCY_US] "
                         "(e.g. 0.05/20) or match:PRESET")
    return LinkModel(parts[0], parts[1] if len(parts) == 2 else 0.0, text)


def calibration(link: LinkModel, this_machine_tflops: Optional[float] = None) -> Dict[str, Any]:
    """Where ``link``'s numbers come from, for reports: a preset as is, numbers as given, or a preset
    scaled to a compute throughput (measured on this machine, or stated: the same on every run)."""
    if link.preset is None:
        method = "preset" if link.spec in PRESETS else "given"
        out: Dict[str, Any] = {"method": method}
    else:
        base = PRESETS[link.preset]
        out = {"method": "measured on this machine" if link.measured else "fixed reference",
               "preset": link.preset, "preset_bandwidth_gbps": base.bandwidth_gbps,
               "preset_latency_us": base.latency_us, "gpu_peak_tflops": GPU_PEAK_TFLOPS["h100"],
               "scaled_for_tflops": link.scaled_for_tflops}
        if not link.measured and link.scaled_for_tflops == REFERENCE_TFLOPS:
            out["reference"] = REFERENCE
    if this_machine_tflops is not None:
        out["this_machine_tflops"] = this_machine_tflops
    return out
