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

A spec string: a preset name, ``GBPS[/LATENCY_US]`` (``"0.05/20"``: 50 MB/s, 20 us), or
``match:PRESET``: the preset's bandwidth scaled by (this machine's measured float32 matmul
throughput / the H100's dense bf16 peak, 989 TFLOP/s), so that a CPU run keeps a GPU node's
compute-to-communication ratio.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Optional, Union

import torch

__all__ = ["LinkModel", "PRESETS", "GPU_PEAK_TFLOPS", "parse_link", "matmul_tflops"]


@dataclass(frozen=True)
class LinkModel:
    """Per-direction bandwidth (GB/s, 1e9 bytes) and per-step latency (microseconds) of one rank's link."""

    bandwidth_gbps: float
    latency_us: float = 0.0
    spec: str = ""  # what the user wrote, for reports

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
        base = PRESETS.get(text[len("match:"):])
        if base is None:
            raise ValueError(f"link {spec!r}: match: needs a preset ({', '.join(PRESETS)})")
        scale = (tflops if tflops is not None else matmul_tflops()) / GPU_PEAK_TFLOPS["h100"]
        return LinkModel(base.bandwidth_gbps * scale, base.latency_us, text)
    try:
        parts = [float(x) for x in text.split("/")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2):
        raise ValueError(f"link {spec!r}: expected a preset ({', '.join(PRESETS)}), GBPS[/LATENCY_US] "
                         "(e.g. 0.05/20) or match:PRESET")
    return LinkModel(parts[0], parts[1] if len(parts) == 2 else 0.0, text)
