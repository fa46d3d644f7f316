"""The host time one checked all-reduce spends in the checks (tplayers.core.fingerprint): making its fingerprint and
laying out its buffer (launch side), and comparing the table that comes back (verify), without the collective
itself (whose gloo latency, about 1 ms on this box, hides them in a timed step). TP 2 CPU ranks, a 64-element
float32 buffer, medians over N calls, microseconds.

    PYTHONPATH=. python benchmarks/check_host_cost.py [N]
"""
import sys
import statistics
import time

import torch

import tplayers
from tplayers.core import fingerprint
from tplayers.core.fingerprint import SLOT, stamp
from tplayers.core.groups import resolve_group
from tplayers.core.stamped import all_reduce_buffers
from tplayers.testing import World


def _rank(group, n):
    g = resolve_group(group)
    buf = torch.zeros(64)
    tplayers.core.collectives.all_reduce(buf, g).wait()  # (the group's first collective agrees on the checks)
    launch, verify = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        s = stamp("all_reduce", 256, buf, g.process_group, g.rank, g.size)
        flat, finish = all_reduce_buffers(buf, s, False)
        t1 = time.perf_counter()
        table = torch.tensor((s.digest + [0] * (SLOT - 8)) * g.size, dtype=torch.float32)  # every rank's slots
        t2 = time.perf_counter()
        fingerprint._verify(table, s)
        buf.copy_(flat[:64])
        t3 = time.perf_counter()
        launch.append((t1 - t0) * 1e6)
        verify.append((t3 - t2) * 1e6)
    return statistics.median(launch), statistics.median(verify)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    with World(2) as world:
        launch, verify = world.run(_rank, n)[0]
    print(f"per checked all-reduce (64 float32, TP 2, CPU): launch side {launch:.1f} us, verify {verify:.1f} us "
          f"(medians of {n})")
