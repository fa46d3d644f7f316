"""What a GPU pays per step beside the collectives, per bench mode, counted on the CPU (tplayers.bench.counts): one
simulated rank of TP ``--tp`` (the fake process group), one steady-state step of each mode, against the block's
local compute (mode ``compute``). Kernels, bytes moved by copies (in activations, b*s*h elements of the dtype), GEMM
FLOPs, host syncs. Deterministic: no timing.

    python benchmarks/step_counts.py --tp 8 [--sequence-parallel]   # hidden 1024, ffn 3584, 16 heads / 8 KV, 2 x 512
"""
from __future__ import annotations

import argparse
import json

from tplayers.bench.config import BenchConfig
from tplayers.bench.counts import count_step
from tplayers.bench.overlap import MODE_TABLE, BenchInputs
from tplayers.bench.simulate import simulated_rank
from tplayers.core.groups import resolve_group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=3584)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--modes", default="compute,tp,tp_blocking,tp_split,tp_chunked,tp_cm")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = BenchConfig(module="block", batch=args.batch, seq=args.seq, hidden=args.hidden, ffn=args.ffn,
                      heads=args.heads, kv_heads=args.kv_heads, activation="swiglu", norm="rmsnorm",
                      sequence_parallel=args.sequence_parallel, chunks=args.chunks)
    activation = args.batch * args.seq * args.hidden * 4  # float32 bytes of one (b, s, h)
    out = {}
    with simulated_rank(args.tp) as group:
        inputs = BenchInputs.create(resolve_group(group), cfg)
        for name in args.modes.split(","):
            if MODE_TABLE[name].skip(inputs) is not None:
                continue
            step = MODE_TABLE[name].build(inputs)
            step()
            step()
            out[name] = count_step(step)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    base = out.get("compute")
    print(f"TP {args.tp}{' SP' if args.sequence_parallel else ''}, (b, s, h) = ({args.batch}, {args.seq}, "
          f"{args.hidden}), ffn {args.ffn}, heads {args.heads} / {args.kv_heads} KV, float32; activations of "
          f"{activation / 1e6:.2f} MB")
    print(f"{'mode':12s} {'kernels':>8s} {'x compute':>9s} {'moved (act)':>11s} {'beyond compute':>14s} "
          f"{'host syncs':>10s}")
    for name, c in out.items():
        ratio = c["kernels"] / base["kernels"] if base else float("nan")
        beyond = (c["moved_bytes"] - base["moved_bytes"]) / activation if base else float("nan")
        print(f"{name:12s} {c['kernels']:8d} {ratio:9.2f} {c['moved_bytes'] / activation:11.2f} {beyond:14.2f} "
              f"{c['host_syncs']:10d}")


if __name__ == "__main__":
    main()
