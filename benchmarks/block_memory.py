"""Activation memory each rank saves for backward in one transformer block.

Runs one forward of a `ParallelTransformerBlock` (and of the dense `DenseTransformerBlock`) under
``torch.autograd.graph.saved_tensors_hooks`` and counts the bytes of the unique storages that
autograd saves, parameters excluded, on every rank of a gloo world of 1, 2 and 4 CPU ranks,
with and without sequence parallelism. Prints a markdown table (and, with ``--detail``, the
saved tensors of each configuration).

    python benchmarks/block_memory.py                       # b=2 s=512 h=512 heads=8 ffn=2048 fp32
    python benchmarks/block_memory.py --detail --tp 2
"""
from __future__ import annotations

import argparse
import datetime
import platform
from collections import defaultdict
from typing import Dict, List, Tuple

import torch

from tplayers import BlockConfig, ParallelTransformerBlock
from tplayers.core.comm import scatter_to_sequence
from tplayers.models.dense import DenseTransformerBlock
from tplayers.testing import get_world, shutdown_worlds


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> Tuple[int, List[Tuple[str, Tuple[int, ...], int]]]:
    """Bytes of the unique non-parameter storages autograd saves in one forward of ``module``."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: Dict[int, int] = {}
    detail: Dict[Tuple[str, Tuple[int, ...]], int] = defaultdict(int)

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in params and ptr not in storages and s.nbytes() > 0:
            storages[ptr] = s.nbytes()
            detail[(str(t.grad_fn.name() if t.grad_fn is not None else "(no grad_fn)"), tuple(t.shape))] += s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    out.sum().backward()  # the saved tensors are all used: a sanity check that the graph is whole
    rows = sorted(((name, shape, n) for (name, shape), n in detail.items()), key=lambda r: -r[2])
    return sum(storages.values()), rows


def _measure(group, config: BlockConfig, batch: int, seq: int, sequence_parallel: bool, dense: bool, seed: int):
    torch.manual_seed(seed)
    x = torch.randn(batch, seq, config.hidden)
    if dense:
        block = DenseTransformerBlock(config)
    else:
        block = ParallelTransformerBlock(config, group=group, sequence_parallel=sequence_parallel)
        if sequence_parallel:
            x = scatter_to_sequence(x, group=group)
    x = x.detach().requires_grad_()  # the block's input is not counted unless the block saves it
    return _saved_bytes(block, x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention (default: = heads)")
    ap.add_argument("--rotary", action="store_true")
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--activation", default="gelu", choices=["gelu", "swiglu"])
    ap.add_argument("--norm", default="layernorm", choices=["layernorm", "rmsnorm"])
    ap.add_argument("--tp", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--detail", action="store_true", help="list the saved tensors of each configuration")
    args = ap.parse_args()
    config = BlockConfig(hidden=args.hidden, n_heads=args.heads, n_kv_heads=args.kv_heads, ffn_hidden=args.ffn,
                         activation=args.activation, norm=args.norm, rotary=args.rotary)
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, gloo")
    print(f"# config: batch={args.batch} seq={args.seq} {config}")
    try:
        (dense_bytes, dense_rows), = get_world(1).run(_measure, config, args.batch, args.seq, False, True, 0)
        print(f"\ndense DenseTransformerBlock: {dense_bytes / 2**20:.2f} MiB saved\n")
        if args.detail:
            for name, shape, n in dense_rows:
                print(f"    {name:28s} {str(shape):22s} {n / 2**20:8.3f} MiB")
        print("| TP | sequence parallel | saved per rank (MiB) | / dense | target 1.1/TP | met |")
        print("|---:|:---:|---:|---:|---:|:---:|")
        for tp in args.tp:
            for sp in (False, True):
                if sp and tp == 1:
                    continue
                results = get_world(tp).run(_measure, config, args.batch, args.seq, sp, False, 0)
                per_rank = max(b for b, _ in results)
                ratio = per_rank / dense_bytes
                target = 1.1 / tp
                met = "yes" if ratio <= target else "no"
                print(f"| {tp} | {'yes' if sp else 'no'} | {per_rank / 2**20:.2f} | {ratio:.3f} | "
                      f"{target:.3f} | {met if sp or tp == 1 else '(n/a)'} |")
                if args.detail:
                    for name, shape, n in results[0][1]:
                        print(f"    {name:28s} {str(shape):22s} {n / 2**20:8.3f} MiB")
    finally:
        shutdown_worlds()


if __name__ == "__main__":
    main()
