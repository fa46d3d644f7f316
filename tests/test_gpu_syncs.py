"""On a GPU the collective checks never make the host wait for the device: a fingerprint's slots reach the device
from pinned memory (a copy from pageable memory synchronizes the stream), and a table still being written is left
for a later collective instead of waited for (it was: one event synchronize per collective, so the host could never
run ahead of the GPU). CUDA only; the CPU side of the same code is covered by the collective-check tests."""
import time

import pytest
import torch

from tplayers.core import fingerprint
from tplayers.core.fingerprint import SLOT, Stamp, check_lagging

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Group:  # stands for a process group: the checker keys its state by the group object
    pass


def _stamp(pg) -> Stamp:
    return Stamp(list(range(1, 9)), 0, 2, pg, "rank 0: test collective", "test", False)


@cuda
def test_fingerprint_slots_reach_the_gpu_without_a_sync():
    s, device = _stamp(_Group()), torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        slots, mine = s.slots(torch.bfloat16, device), s.mine(torch.float32, device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert slots.device.type == "cuda" and slots[:8].tolist() == list(range(1, 9))
    assert mine[:8].tolist() == list(range(1, 9))


@cuda
def test_a_table_the_gpu_has_not_written_is_not_waited_for():
    pg, device = _Group(), torch.device("cuda")
    s = _stamp(pg)
    table = torch.tensor((list(range(1, 9)) + [0] * (SLOT - 8)) * 2, dtype=torch.float32, device=device)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time ahead of the table's copy
    s.check(table)  # queued behind the sleep
    started = time.perf_counter()
    check_lagging(pg)  # the table is not on the host yet: left for later
    waited = time.perf_counter() - started
    assert waited < 0.05 and len(fingerprint._GROUPS[pg].lagging) == 1
    check_lagging(pg, wait=True)  # (an all-to-all's split sizes: checked now)
    assert len(fingerprint._GROUPS[pg].lagging) == 0
    torch.cuda.synchronize()


@cuda
def test_too_many_waiting_tables_wait_for_the_oldest(monkeypatch):
    monkeypatch.setattr(fingerprint, "MAX_LAGGING", 2)
    pg, device = _Group(), torch.device("cuda")
    table = torch.tensor((list(range(1, 9)) + [0] * (SLOT - 8)) * 2, dtype=torch.float32, device=device)
    torch.cuda._sleep(200_000_000)
    for _ in range(3):
        _stamp(pg).check(table)
    check_lagging(pg)  # 3 > 2 waiting: the oldest waited for (and any the GPU has written since)
    assert len(fingerprint._GROUPS[pg].lagging) <= 2
    torch.cuda.synchronize()
