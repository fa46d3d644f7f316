"""Ranks in step: a rank that issues a different collective than the others (an evaluation on rank 0
only, a retried step, a skipped backward) fails on that call, on every rank, naming each side; a rank
that never comes is named after the configured wait. Before these checks each case computed wrong
numbers with no error (or waited out the process group's 30 minutes)."""
import time

import pytest
import torch
import torch.nn as nn

import tplayers
from tplayers import CollectivesOutOfStep
from tplayers.testing import World, get_world

from _helpers import MULTI_RANK


def _mlps(group, layers=2, h=8):
    torch.manual_seed(0)
    return nn.Sequential(*[tplayers.ParallelMLP(h, 2 * h, group=group, dtype=torch.float64) for _ in range(layers)])


def _outcome(fn):
    try:
        fn()
    except CollectivesOutOfStep as e:
        return str(e)
    return "no error"


def _eval_on_one_rank_at_a_time(group, checks):
    previous = tplayers.set_collective_checks(checks)
    try:
        rank = torch.distributed.get_rank()
        model = _mlps(group)
        dense = nn.Sequential(*[m.to_dense() for m in model])
        x = torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        evaluated = []

        def evaluate():
            with torch.no_grad():
                model.eval()
                try:
                    evaluated.append(float((model(x * 2) - dense(x * 2)).abs().max()))
                finally:
                    model.train()

        def step():  # rank 0 evaluates before its training step, the others after it: the counts agree
            if rank == 0:
                evaluate()
            model(x).sum().backward()
            if rank != 0:
                evaluate()

        message = _outcome(step)
        torch.distributed.barrier(group)  # nothing was left in flight: the group works on
        return message, evaluated, float((model(x) - dense(x)).abs().max())
    finally:
        tplayers.set_collective_checks(previous[0], timeout=previous[1])


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_an_evaluation_out_of_step_fails_on_every_rank_naming_both_sides(tp):
    for message, evaluated, err in get_world(tp).run(_eval_on_one_rank_at_a_time, True):
        assert "ranks of a TP group are out of step" in message and evaluated == [], message
        assert "rank 0: forward all_reduce #" in message and "at 0.fc2 (eval mode, autograd off)" in message, message
        assert "rank 1: forward all_reduce #" in message and "at 0.fc2 (training mode, autograd on)" in message, message
        assert err < 1e-12  # and a step in step afterwards matches the dense model
    # With the check off the same program runs with no error, and rank 0's evaluation is wrong.
    results = get_world(2).run(_eval_on_one_rank_at_a_time, False)
    assert [m for m, _, _ in results] == ["no error"] * 2 and results[0][1][0] > 1e-3, results


def _retry_after_an_exception(group):
    rank = torch.distributed.get_rank()
    model = _mlps(group, layers=3)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    failed = []

    def fail_once(module, args):
        if rank == 1 and not failed:
            failed.append(True)
            raise RuntimeError("a transient error on rank 1")

    model[1].register_forward_pre_hook(fail_once)

    def step():
        for _ in range(2):  # a retry loop: rank 1 catches its error and runs the step again
            try:
                return model(x)
            except RuntimeError as e:
                if "transient" not in str(e):
                    raise

    return _outcome(step)


def test_a_rank_that_retries_a_step_alone_fails_naming_the_layers():
    for message in get_world(2).run(_retry_after_an_exception):
        assert "of (2, 3, 8) float64 at 1.fc2 (training mode, autograd on)" in message, message
        assert "of (2, 3, 8) float64 at 0.fc2 (training mode, autograd on)" in message, message


def _skip_a_backward(group):
    rank = torch.distributed.get_rank()
    model = _mlps(group)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)

    def steps():
        for step in range(2):
            loss = model(x).sum()
            if not (rank == 1 and step == 0):  # rank 1 skips a step's backward (a "bad batch" check of its own)
                loss.backward()

    return _outcome(steps)


def test_a_rank_that_skips_a_backward_fails_at_the_next_collective():
    messages = get_world(2).run(_skip_a_backward)
    for message in messages:
        assert "rank 0: backward all_reduce" in message and "collective 1 of this backward" in message, message
        assert "rank 1: forward all_reduce #" in message and "at 0.fc2" in message, message


def _tiny_llama(group, layers):
    """A float64 Hugging Face Llama of ``layers`` layers, parallelized with "auto"."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                      tie_word_embeddings=False)
    return tplayers.parallelize(LlamaForCausalLM(cfg).double(), "auto", group=group)


def _hf_eval_on_rank0_only(group):
    model = _tiny_llama(group, 2)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()  # a first step in step (the audit runs here)

    def step():
        if torch.distributed.get_rank() == 0:
            with torch.no_grad():
                model(ids)
        model(ids, labels=ids).loss.backward()

    return _outcome(step)


def test_a_hugging_face_model_names_the_module_that_ran_out_of_step():
    pytest.importorskip("transformers")
    for message in get_world(2).run(_hf_eval_on_rank0_only):
        assert "at model.embed_tokens (training mode, autograd off)" in message, message


def _a_rank_that_never_comes(group):
    tplayers.set_collective_checks(True, timeout=2)
    rank = torch.distributed.get_rank()
    model = _mlps(group, layers=1)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    t0 = time.monotonic()
    if rank == 1:  # raised, caught, and went on with something else
        time.sleep(6)
        return "rank 1 went on", 0.0
    return _outcome(lambda: model(x)), time.monotonic() - t0


def test_a_rank_that_never_comes_is_reported_after_the_wait():
    with World(2) as world:  # a fresh world: the abandoned collective leaves its group unusable
        (message, seconds), _ = world.run(_a_rank_that_never_comes)
    assert "waited 2 s for the other ranks of the TP group" in message and "at 0.fc2" in message, message
    assert seconds < 5, seconds


def _a_rank_that_skips_the_experts_backward(group):
    from tplayers.models.moe import DenseMoE

    tplayers.set_collective_checks(True, timeout=2)
    torch.manual_seed(0)
    moe = tplayers.ParallelMoE.from_dense(DenseMoE(8, 4, 4, 2, dtype=torch.float64), group=group,
                                          experts="all_to_all", sequence_parallel=True)
    out = moe(torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True))
    t0 = time.monotonic()
    if torch.distributed.get_rank() == 1:  # its backward never comes
        time.sleep(6)
        return "rank 1 went on", 0.0
    return _outcome(lambda: out.sum().backward()), time.monotonic() - t0


def test_an_all_to_all_that_a_rank_never_joins_is_reported_after_the_wait():
    """The token dispatch's all-to-alls carry no fingerprint (the counts before them do): their wait is bounded."""
    with World(2) as world:  # a fresh world: the abandoned collective leaves its group unusable
        (message, seconds), _ = world.run(_a_rank_that_skips_the_experts_backward)
    assert "waited 2 s for the other ranks of the TP group at this collective (all_to_all of" in message, message
    assert seconds < 5, seconds


def _dispatch_out_of_step_on_a_gpu(group):
    """As on a GPU (fingerprint tables checked one collective late): rank 0 dispatches MoE tokens, rank 1 issues
    another all-gather of the same shape. The all-to-all checks the counts' table before it launches (it
    launched, and rank 0 waited in it for the other rank)."""
    from tplayers.core import fingerprint
    from tplayers.core.blocking import all_gather_tensor
    from tplayers.models.moe import DenseMoE

    previous = tplayers.set_collective_checks(True, timeout=10)
    fingerprint._LAG_ON_CPU[0] = True
    try:
        torch.manual_seed(0)
        moe = tplayers.ParallelMoE.from_dense(DenseMoE(8, 4, 4, 2, dtype=torch.float64), group=group,
                                              experts="all_to_all", sequence_parallel=True)
        x = torch.randn(2, 3, 8, dtype=torch.float64)
        if torch.distributed.get_rank() == 0:
            return _outcome(lambda: moe(x))
        pg = tplayers.resolve_group(group).process_group
        return _outcome(lambda: (all_gather_tensor(torch.zeros(1, 4, dtype=torch.long), 0, group=group),
                                 fingerprint.check_lagging(pg)))
    finally:
        fingerprint._LAG_ON_CPU[0] = False
        tplayers.set_collective_checks(previous[0], timeout=previous[1])


def test_token_dispatch_checks_its_counts_before_any_token_moves():
    for message in get_world(2).run(_dispatch_out_of_step_on_a_gpu):
        assert "forward all_gather" in message and "checked when the group's next collective launched" in message, \
            message


def _checked_one_collective_late(group):
    from tplayers.core import fingerprint

    fingerprint._LAG_ON_CPU[0] = True  # as on a GPU: the table reaches the host without a sync
    try:
        return _eval_on_one_rank_at_a_time(group, True)[0]
    finally:
        fingerprint._LAG_ON_CPU[0] = False


def test_on_a_gpu_the_check_runs_when_the_next_collective_launches():
    for message in get_world(2).run(_checked_one_collective_late):
        assert "rank 0: forward all_reduce #" in message and "at 0.fc2 (eval mode, autograd off)" in message, message
        assert "checked when the group's next collective launched" in message, message


def _labels_outside_forward(group, same):
    model = _tiny_llama(group, 1)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    seed = 1 if same else 1 + torch.distributed.get_rank()  # a sampler over the TP ranks hands each its own labels
    labels = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(seed))
    logits = model(ids).logits  # the labels never pass through forward: check_same_inputs cannot see them
    loss = nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1))
    try:
        loss.backward()
    except ValueError as e:
        return str(e)
    return "no error"


def test_labels_that_differ_across_ranks_outside_forward_are_refused_in_backward():
    pytest.importorskip("transformers")
    for message in get_world(2).run(_labels_outside_forward, False):
        assert "the gradient of lm_head's output" in message and "rank(s) [1]" in message, message
        assert "the ranks' losses differ" in message, message
    assert get_world(2).run(_labels_outside_forward, True) == ["no error"] * 2


def _float16_partials_that_overflow(group, sequence_parallel):
    dense = nn.Linear(2, 1, bias=False).half()
    with torch.no_grad():
        dense.weight.copy_(torch.tensor([[250.0, -200.0]]))  # rank 0's partial 300 * 250 = 75000 > 65504
    row = tplayers.RowParallelLinear.from_dense(dense, group=group, sequence_parallel=sequence_parallel)
    x = torch.full((1, 2, 2), 300.0, dtype=torch.float16)
    expected = float(dense(x)[0, 0, 0])  # the dense sum: 15000, finite
    x_local = x.chunk(2, dim=-1)[torch.distributed.get_rank()]
    try:
        row(x_local)
    except FloatingPointError as e:
        return str(e), expected
    return "no error", expected


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_float16_partial_sums_that_overflow_are_reported_on_every_rank(sequence_parallel):
    for message, expected in get_world(2).run(_float16_partials_that_overflow, sequence_parallel):
        assert expected == 15000.0
        assert "float16 overflow in the row-parallel sum at RowParallelLinear" in message, message
        assert "rank(s) [0]" in message and "bfloat16" in message, message



class _Work:
    """A collective's work handle whose wait fails after ``delay`` seconds, as gloo's does."""

    def __init__(self, delay: float, error: str) -> None:
        self.delay, self.error = delay, error

    def wait(self, timeout=None) -> None:
        time.sleep(self.delay)
        raise RuntimeError(self.error)


def test_a_wait_cut_short_by_a_closed_connection_says_so():
    """Before: 'waited 60 s for the other ranks' although the collective failed at once, a peer having gone (the
    message printed the configured wait for any error)."""
    from tplayers.core.fingerprint import CollectivesOutOfStep, bounded_wait

    before = tplayers.set_collective_checks(True, timeout=60)
    try:
        with pytest.raises(CollectivesOutOfStep) as closed:
            bounded_wait(_Work(0.0, "Connection closed by peer [127.0.0.1]:1234"), "all_reduce at 0.fc2", cpu=True)
        tplayers.set_collective_checks(True, timeout=0.2)
        with pytest.raises(CollectivesOutOfStep) as timed_out:
            bounded_wait(_Work(0.2, "Timed out waiting 200ms"), "all_reduce at 0.fc2", cpu=True)
    finally:
        tplayers.set_collective_checks(before[0], timeout=before[1])
    assert "failed after 0.0 s (of the 60 s allowed)" in str(closed.value), closed.value
    assert "closed its connection" in str(closed.value) and "waited" not in str(closed.value)
    assert "waited 0.2 s for the other ranks of the TP group at this collective" in str(timed_out.value)


def _checks_off_on_one_rank(group, through_link: bool = False):
    """Checks on on rank 0, off on rank 1 (as `TPLAYERS_COLLECTIVE_CHECKS=0` on one node), on a group whose first
    collective is this test's. ``through_link``: that first collective runs inside an emulated link (`tplayers bench
    --link`), which turns the checks off on every rank and, leaving, restores each rank's own setting."""
    import torch.distributed as dist

    fresh = dist.new_group(ranks=[0, 1])
    before = tplayers.set_collective_checks(dist.get_rank() == 0, timeout=5.0)
    try:
        if through_link:
            with tplayers.emulated_link("h100-nvlink"):
                tplayers.core.blocking.all_reduce_tensor(torch.ones(3), group=fresh)
        tplayers.core.blocking.all_reduce_tensor(torch.ones(3), group=fresh)
    except CollectivesOutOfStep as e:
        return str(e)
    finally:
        tplayers.set_collective_checks(before[0], timeout=before[1])
    return "no error"


def test_collective_checks_off_on_one_rank_only_are_named():
    """Before: gloo aborted one rank (a checked buffer is 13 elements per rank longer than an unchecked one) and the
    other read 'waited 600 s'; the setting itself was never named."""
    for message in get_world(2).run(_checks_off_on_one_rank):
        assert "collective checks are on on rank(s) [0] and off on rank(s) [1]" in message, message
        assert "TPLAYERS_COLLECTIVE_CHECKS" in message, message


def _hf_eval_on_rank0_at_the_first_forward(group):
    model = _tiny_llama(group, 1)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    prompt = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(1))
    try:
        if torch.distributed.get_rank() == 0:  # a sanity generation on rank 0 before training
            with torch.no_grad():
                model.eval()
                model(prompt)
        model.train()
        model(ids, labels=ids).loss.backward()
    except (ValueError, CollectivesOutOfStep) as e:
        return str(e)
    return "no error"


def test_an_evaluation_on_rank_0_at_the_first_forward_is_named_as_such():
    """Before: both ranks were told their batches differ (fix the data loader): the first-forward inputs check
    paired rank 0's evaluation with rank 1's training forward."""
    pytest.importorskip("transformers")
    for message in get_world(2).run(_hf_eval_on_rank0_at_the_first_forward):
        assert "rank 0: eval mode, autograd off" in message and "rank 1: training mode, autograd on" in message, message
        assert "data loader" not in message and "sampler" not in message, message


def test_checks_that_differ_once_a_tool_restores_them_are_named_on_every_rank():
    """Before: the group had agreed on 'off' inside the link; after it, rank 0 sent a checked buffer (13 elements per
    rank longer) and rank 1 an unchecked one: gloo aborted a rank. Every set_collective_checks call (made on every
    rank alike, as the link's enter and exit are) now has each group compare the setting again at its next
    collective."""
    from tplayers.testing import World

    with World(2) as world:  # a fresh world: on main a rank dies
        messages = world.run(_checks_off_on_one_rank, True)
    for message in messages:
        assert "collective checks are on on rank(s) [0] and off on rank(s) [1]" in message, message
