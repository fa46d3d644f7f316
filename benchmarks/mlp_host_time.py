"""The host time of one sequence-parallel ParallelMLP step, the GPU-side Python a rank pays per step: one simulated
rank of TP 8 on the fake process group (collectives move nothing), shapes small enough that the CPU's arithmetic
is a small part (hidden 64, SwiGLU ffn 128, 2 x 2 tokens per rank), forward + backward, min of 5 runs of 200 steps.

    PYTHONPATH=<tree> python benchmarks/mlp_host_time.py   # run base and head alternately: paired ratios
"""
import time
from typing import Callable

import torch

from tplayers import ParallelMLP
from tplayers.bench.simulate import simulated_rank
from tplayers.models.dense import DenseMLP


def min_us_per_step(step: Callable[[], None], warmup: int = 50, runs: int = 5, steps: int = 200) -> float:
    """Microseconds per call of ``step``: the fastest of ``runs`` runs of ``steps`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    best = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        best.append((time.perf_counter() - t0) / steps * 1e6)
    return min(best)


def main() -> None:
    torch.set_num_threads(1)
    with simulated_rank(8) as group:
        mlp = ParallelMLP.from_dense(DenseMLP(64, 128, "swiglu", False), group=group, sequence_parallel=True)
        x = torch.randn(2, 2, 64, requires_grad=True)

        def step() -> None:
            mlp(x).sum().backward()

        us = min_us_per_step(step)
    print(f"{us:.1f} us per SP ParallelMLP forward + backward (TP 8 simulated rank, min of 5 x 200 steps)")


if __name__ == "__main__":
    main()
