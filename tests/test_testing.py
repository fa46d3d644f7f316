"""The rank world never hangs and never hides a failure; assert_matches_dense can fail."""
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tplayers import ColumnParallelLinear, RowParallelLinear
from tplayers.testing import RankFailed, World, WorldTimeout, assert_matches_dense, get_world


def _rank_and_size(group):
    return dist.get_rank(group), dist.get_world_size(group)


def _fail_on_rank(group, bad_rank):
    if dist.get_rank(group) == bad_rank:
        raise KeyError("planted failure")
    dist.barrier(group=group)  # the healthy ranks now wait for the failed one: must not hang the call
    return True


def _hang_on_rank(group, bad_rank):
    if dist.get_rank(group) == bad_rank:
        time.sleep(60)
    return True


def _crash_on_rank(group, bad_rank):
    if dist.get_rank(group) == bad_rank:
        os._exit(3)
    dist.barrier(group=group)
    return True


def test_results_come_back_in_rank_order():
    assert get_world(4).run(_rank_and_size) == [(r, 4) for r in range(4)]


def test_failure_on_one_rank_fails_the_call_with_its_traceback_and_world_recovers():
    world = get_world(2)
    world.run(_rank_and_size)
    starts = world.starts
    with pytest.raises(RankFailed, match="planted failure") as info:
        world.run(_fail_on_rank, 1, timeout=60)
    assert info.value.rank == 1 and "KeyError" in info.value.remote_traceback
    assert world.run(_rank_and_size) == [(0, 2), (1, 2)]
    assert world.starts == starts + 1, "the world must be rebuilt after a failure"


def test_hung_rank_times_out_and_world_recovers():
    with World(2) as world:
        world.run(_rank_and_size)  # warm: the timed call below must not pay for imports
        t0 = time.monotonic()
        # rank 1 sleeps 60 s; rank 0 answers at once, even on a loaded machine
        with pytest.raises(WorldTimeout, match=r"ranks \[1\] of 2 did not finish"):
            world.run(_hang_on_rank, 1, timeout=8)
        assert time.monotonic() - t0 < 30
        # the rebuilt world gets an ordinary timeout: a fresh rank's first call can be slow under load
        assert world.run(_rank_and_size, timeout=120) == [(0, 2), (1, 2)]


def test_crashed_rank_fails_the_call():
    world = get_world(2)
    with pytest.raises(RankFailed, match=r"rank 1 died \(exit code 3\)"):
        world.run(_crash_on_rank, 1, timeout=60)
    assert world.run(_rank_and_size) == [(0, 2), (1, 2)]


def _abort_on_rank(group, bad_rank):
    if dist.get_rank(group) == bad_rank:
        os.write(2, b"terminate called after throwing an instance of 'gloo::EnforceNotMet'\n")  # as C++ writes it
        os.abort()
    dist.barrier(group=group)
    return True


def test_a_rank_that_dies_says_how_and_what_it_wrote_last():
    """Before: "rank 1 closed its pipe (exit code None)", nothing of why (issue 53)."""
    world = get_world(2)
    with pytest.raises(RankFailed) as info:
        world.run(_abort_on_rank, 1, timeout=60)
    message = str(info.value)
    assert info.value.rank == 1 and "rank 1 died (signal SIGABRT)" in message, message
    assert "gloo::EnforceNotMet" in message.split("its last lines on stderr:")[1], message
    assert world.run(_rank_and_size) == [(0, 2), (1, 2)]


def test_unpicklable_function_is_a_clear_error():
    with pytest.raises(TypeError, match="module-level function"):
        get_world(1).run(lambda group: 1)


def _check_detects_wrong_weight(group, which):
    torch.manual_seed(0)
    dense = nn.Linear(4, 8, dtype=torch.float64)
    tp = ColumnParallelLinear.from_dense(dense, group=group, gather_output=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    if which == "weight":
        with torch.no_grad():
            tp.weight[0, 0] += 1e-6 if dist.get_rank(group) == dist.get_world_size(group) - 1 else 0.0
    elif which == "grad":
        tp.weight.register_hook(lambda g: g * 1.001)  # output right, weight gradient wrong
    try:
        assert_matches_dense(tp, dense, x, group=group)
    except AssertionError as e:
        return str(e)
    return None


@pytest.mark.parametrize("which", ["weight", "grad"])
def test_assert_matches_dense_detects_a_wrong_module(which):
    messages = get_world(2).run(_check_detects_wrong_weight, which)
    assert all(m is not None for m in messages), "a wrong TP module must not pass"
    expected = "output differs" if which == "weight" else "gradient of parameter 'weight' differs"
    assert all(expected in m for m in messages), messages


class _ScaleInputGrad(nn.Module):
    """Runs ``inner``; scales the gradient flowing back to the input by ``scale``."""

    def __init__(self, inner, scale):
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, x):
        x = x * 1.0
        if self.scale != 1.0:
            x.register_hook(lambda g: g * self.scale)
        return self.inner(x)


def _check_detects_wrong_input_grad(group):
    torch.manual_seed(0)
    dense = nn.Linear(8, 4, dtype=torch.float64)
    tp = RowParallelLinear.from_dense(dense, group=group)
    try:
        assert_matches_dense(_ScaleInputGrad(tp, 2.0), _ScaleInputGrad(dense, 1.0),
                             torch.randn(2, 8, dtype=torch.float64), group=group, input_shard_dims=[-1])
    except AssertionError as e:
        return str(e)
    return None


def test_assert_matches_dense_detects_wrong_input_gradient():
    messages = get_world(2).run(_check_detects_wrong_input_grad)
    assert all(m is not None and "gradient of input 0" in m for m in messages), messages


def test_idle_world_stays_up_between_calls():
    world = get_world(2)
    world.run(_rank_and_size)
    starts = world.starts
    time.sleep(2.5)  # longer than a rank's idle poll
    world.run(_rank_and_size)
    assert world.starts == starts, "an idle world must not restart"


def _bf16_wrong_gradient(group):
    """A bfloat16 weight gradient 25% off on every element: far beyond rounding, so the float64-truth fallback
    (low precision: TP at most twice as far from the truth as dense) must not pass it."""
    torch.manual_seed(0)
    dense = nn.Linear(16, 32, dtype=torch.bfloat16)
    tp = ColumnParallelLinear.from_dense(dense, group=group, gather_output=True)
    tp.weight.register_hook(lambda g: g * 1.25)
    try:
        assert_matches_dense(tp, dense, torch.randn(3, 16, dtype=torch.bfloat16), group=group)
    except AssertionError as e:
        return str(e)
    return None


def test_assert_matches_dense_in_bfloat16_still_detects_a_wrong_gradient():
    for message in get_world(2).run(_bf16_wrong_gradient):
        assert message is not None and "gradient of parameter 'weight' differs" in message, message
        assert "against the float64 truth its max abs error is" in message, message
