"""What one ``tplayers bench`` run measures (:class:`BenchConfig`), its named shapes and the names of its modes
and modules; checked before any rank starts. The modes themselves: :mod:`tplayers.bench.overlap`; the
modules: :mod:`tplayers.bench.modules`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..core.dtypes import DTYPES
from .link import parse_link

__all__ = ["BenchConfig", "LAYER_SHAPES", "MODES", "MODULE_NAMES", "SHAPES"]

#: The modes, in the order they run (each one entry of :data:`tplayers.bench.overlap.MODE_TABLE`).
MODES: Tuple[str, ...] = ("tp", "tp_blocking", "tp_split", "tp_chunked", "tp_cm", "comm", "comm_bwd", "compute",
                          "dense", "naive")
#: The modules a run times (each one entry of :data:`tplayers.bench.modules.MODULES`).
MODULE_NAMES: Tuple[str, ...] = ("mlp", "column", "block")

# Named shapes: latency-bound, compute-bound, and communication-heavy (many tokens, narrow hidden).
SHAPES: Dict[str, Dict[str, int]] = {
    "small": dict(batch=1, seq=16, hidden=64, ffn=256),
    "large": dict(batch=4, seq=256, hidden=512, ffn=2048),
    "comm-heavy": dict(batch=8, seq=1024, hidden=64, ffn=256),
}

# One real model layer (implies --module block): Llama-3 8B / 70B (hidden, ffn, heads, KV heads from
# their published configs); few tokens, so one rank's compute fits this machine.
LAYER_SHAPES: Dict[str, Dict[str, Any]] = {
    "llama3-8b": dict(batch=1, seq=128, hidden=4096, ffn=14336, heads=32, kv_heads=8, activation="swiglu",
                      norm="rmsnorm"),
    "llama3-70b": dict(batch=1, seq=64, hidden=8192, ffn=28672, heads=64, kv_heads=8, activation="swiglu",
                       norm="rmsnorm"),
}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: module, shape ``[batch, seq, hidden]`` (ffn for the MLP and the block; heads
    for the block), precision, modes."""

    module: str = "mlp"  # "mlp" (Column -> GELU -> Row) | "column" | "block" (ParallelTransformerBlock)
    batch: int = 8
    seq: int = 1024
    hidden: int = 64
    ffn: int = 256
    heads: int = 4  # attention heads of the block (MHA, head_dim = hidden / heads)
    kv_heads: Optional[int] = None  # block: grouped-query attention (None: = heads)
    activation: str = "gelu"  # block: "gelu" | "swiglu"
    norm: str = "layernorm"  # block: "layernorm" | "rmsnorm"
    dtype: str = "float32"
    device: str = "cpu"
    sequence_parallel: bool = False
    iters: int = 50
    warmup: int = 5
    modes: Tuple[str, ...] = MODES  # every mode
    seed: int = 0
    progress: bool = False
    trace_dir: Optional[str] = None
    trace_iters: int = 3
    link: Optional[str] = None  # an emulated interconnect (tplayers.bench.link spec), None: the real backend
    default_link: bool = False  # the link is the CPU default (DEFAULT_CPU_LINK), not asked for
    chunks: int = 2  # mode tp_chunked: batch chunks (forward overlap, Domino-style)

    def __post_init__(self) -> None:
        if self.module not in MODULE_NAMES:
            raise ValueError(f"bench: unknown module {self.module!r} (choose from {sorted(MODULE_NAMES)})")
        if self.dtype not in DTYPES:
            raise ValueError(f"bench: unknown dtype {self.dtype!r} (choose from {sorted(DTYPES)})")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"bench: unknown modes {unknown} (choose from {list(MODES)})")
        for name in ("batch", "seq", "hidden", "ffn", "heads", "iters", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench: {name}={getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"bench: warmup={self.warmup} must be >= 0")
        if self.module == "block" and self.hidden % self.heads:
            raise ValueError(f"bench: hidden={self.hidden} is not divisible by heads={self.heads} (block)")
        if self.link is not None:
            try:  # the spec's syntax, now (match: measures later, on the ranks)
                parse_link(self.link, tflops=1.0)
            except ValueError as e:
                raise ValueError(f"bench: {e}") from None

    def check_tp(self, tp: int) -> None:
        """Clear errors for shapes the TP degree does not divide."""
        if self.ffn % tp:
            raise ValueError(f"bench: ffn={self.ffn} is not divisible by the TP degree {tp}")
        if self.module == "block" and self.heads % tp:
            raise ValueError(f"bench: heads={self.heads} is not divisible by the TP degree {tp} (block)")
        if self.sequence_parallel and self.seq % tp:
            raise ValueError(f"bench: seq={self.seq} is not divisible by the TP degree {tp} (sequence parallel)")
