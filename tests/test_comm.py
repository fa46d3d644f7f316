"""Every differentiable collective against what it must compute, forward and backward.

Each rank draws its own data from (seed, rank), so every rank can rebuild what all the others
held and compute the expected result locally, without trusting any collective.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import examples
from _helpers import TP_SIZES

from tplayers.core import blocking, collectives, comm
from tplayers.testing import get_world


def _rank_tensor(seed, rank, shape):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _all_ranks(seed, size, shape):
    return [_rank_tensor(seed, r, shape) for r in range(size)]


def _check_collective(group, op, seed, shape):
    rank, size = group.rank(), group.size()
    xs = _all_ranks(seed, size, shape)  # every rank's input
    gs_seed = seed + 7
    if op == "copy_to_tp":
        x = xs[0].clone().requires_grad_()  # replicated input
        y = comm.copy_to_tp(x, group=group)
        expect_y = xs[0]
        up = _all_ranks(gs_seed, size, y.shape)
        expect_grad = sum(up)
    elif op == "reduce_from_tp":
        x = xs[rank].clone().requires_grad_()
        before = x.detach().clone()
        y = comm.reduce_from_tp(x, group=group)
        assert torch.equal(x.detach(), before), "reduce_from_tp modified its input in place"
        expect_y = sum(xs)
        up = [_rank_tensor(gs_seed, 0, y.shape)] * size  # downstream is replicated
        expect_grad = up[0]
    elif op == "scatter_to_tp":
        x = xs[0].clone().requires_grad_()
        y = comm.scatter_to_tp(x, group=group)
        expect_y = xs[0].chunk(size, -1)[rank]
        up = _all_ranks(gs_seed, size, y.shape)
        expect_grad = torch.cat(up, -1)
    elif op == "gather_from_tp":
        x = xs[rank].clone().requires_grad_()
        y = comm.gather_from_tp(x, group=group)
        expect_y = torch.cat(xs, -1)
        up = [_rank_tensor(gs_seed, 0, y.shape)] * size
        expect_grad = up[0].chunk(size, -1)[rank]
    elif op == "scatter_to_sequence":
        x = xs[0].clone().requires_grad_()
        y = comm.scatter_to_sequence(x, group=group)
        expect_y = xs[0].chunk(size, -2)[rank]
        up = _all_ranks(gs_seed, size, y.shape)
        expect_grad = torch.cat(up, -2)
    elif op in ("gather_from_sequence", "gather_from_sequence_replicated"):
        partial = op == "gather_from_sequence"
        x = xs[rank].clone().requires_grad_()
        y = comm.gather_from_sequence(x, group=group, grad_is_partial=partial)
        expect_y = torch.cat(xs, -2)
        if partial:  # each rank's consumer contributes a partial gradient: reduce-scatter
            up = _all_ranks(gs_seed, size, y.shape)
            expect_grad = sum(up).chunk(size, -2)[rank]
        else:
            up = [_rank_tensor(gs_seed, 0, y.shape)] * size
            expect_grad = up[0].chunk(size, -2)[rank]
    elif op == "reduce_scatter_to_sequence":
        x = xs[rank].clone().requires_grad_()
        before = x.detach().clone()
        y = comm.reduce_scatter_to_sequence(x, group=group)
        assert torch.equal(x.detach(), before), "reduce_scatter modified its input in place"
        expect_y = sum(xs).chunk(size, -2)[rank]
        up = _all_ranks(gs_seed, size, y.shape)
        expect_grad = torch.cat(up, -2)
    else:
        raise ValueError(op)
    torch.testing.assert_close(y, expect_y, rtol=1e-12, atol=1e-12)
    y.backward(up[rank])
    torch.testing.assert_close(x.grad, expect_grad, rtol=1e-12, atol=1e-12)
    return True


OPS = ["copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "scatter_to_sequence",
       "gather_from_sequence", "gather_from_sequence_replicated", "reduce_scatter_to_sequence"]


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("op", OPS)
@settings(max_examples=examples(4))
@given(
    seed=st.integers(0, 2**16),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    seq_mult=st.integers(1, 3),
    hidden_mult=st.integers(1, 3),
)
def test_collective_matches_definition(tp, op, seed, lead, seq_mult, hidden_mult):
    shape = tuple(lead) + (4 * seq_mult, 4 * hidden_mult)  # (..., seq, hidden), divisible by 4
    assert all(get_world(tp).run(_check_collective, op, seed, shape))


def _check_noncontiguous_and_shared_grads(group):
    """Gradients handed to a collective may be non-contiguous (expand from .sum()) or shared
    with another consumer; the reduction must not be lost nor leak into the other branch."""
    size = group.size()
    x = torch.ones(3, 4, dtype=torch.float64, requires_grad=True)
    y = comm.copy_to_tp(x.t(), group=group)  # non-contiguous view in
    other = x.t() * 1.0
    (y + other).sum().backward()  # both consumers receive the same expanded grad tensor
    torch.testing.assert_close(x.grad, torch.full((3, 4), size + 1.0, dtype=torch.float64))

    a = torch.arange(12.0, dtype=torch.float64).reshape(3, 4)
    view = a.t()  # non-contiguous, non-owning
    out = comm.reduce_from_tp(view, group=group)
    torch.testing.assert_close(out, view * size)
    torch.testing.assert_close(a, torch.arange(12.0, dtype=torch.float64).reshape(3, 4))
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_are_contiguity_and_ownership_safe(tp):
    assert all(get_world(tp).run(_check_noncontiguous_and_shared_grads))


def _check_helpers(group):
    rank, size = group.rank(), group.size()
    x = torch.full((2, 3), float(rank))
    gathered = blocking.all_gather_tensor(x, 1, group=group)
    assert gathered.shape == (2, 3 * size)
    assert torch.equal(gathered[:, 3 * rank:3 * rank + 3], x)
    before = x.clone()
    total = blocking.all_reduce_tensor(x, group=group)
    assert torch.equal(x, before) and torch.equal(total, torch.full((2, 3), float(sum(range(size)))))
    b = blocking.broadcast_tensor(x, size - 1, group=group)
    assert torch.equal(b, torch.full((2, 3), float(size - 1)))
    return True


@pytest.mark.parametrize("tp", TP_SIZES)
def test_non_differentiable_helpers(tp):
    assert all(get_world(tp).run(_check_helpers))


def _check_indivisible_split(group):
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match="not divisible by the TP degree"):
        comm.scatter_to_tp(x, group=group)
    with pytest.raises(ValueError, match="not divisible by the TP degree"):
        comm.reduce_scatter_to_sequence(torch.randn(5, 4), group=group)
    return True


def test_indivisible_split_raises_clearly():
    assert all(get_world(2).run(_check_indivisible_split))


def test_world_of_one_needs_no_process_group():
    x = torch.randn(2, 3, requires_grad=True)
    for fn in (comm.copy_to_tp, comm.reduce_from_tp, comm.scatter_to_tp, comm.gather_from_tp,
               comm.scatter_to_sequence, comm.gather_from_sequence, comm.reduce_scatter_to_sequence):
        assert fn(x, group=None) is x


def _check_blocking_means_done_on_return(group):
    """A collective called without async_op is complete when the call returns, fingerprinted or not:
    overlap_comm=False relies on it (the weight-gradient GEMM after the call must not run under it)."""
    from tplayers.core.fingerprint import set_collective_checks
    from tplayers.core.groups import resolve_group

    g = resolve_group(group)
    done = []
    for checks in (True, False):
        before = set_collective_checks(checks)
        try:
            buf = torch.full((4, 3), float(g.rank + 1))
            collectives.all_reduce(buf, g)  # not waited on: blocking means done
            src = torch.full((g.size * 2, 3), float(g.rank + 1))
            gathered = collectives.all_gather(src[:2].clone(), 0, g)
            scattered = collectives.reduce_scatter(src, 0, g)
            done.append(bool((buf == sum(range(1, g.size + 1))).all()))
            done.append(gathered._result is not None and scattered._result is not None)
        finally:
            set_collective_checks(*before[:1], timeout=before[1])
    return done


def test_a_blocking_collective_is_done_when_the_call_returns():
    for done in get_world(2).run(_check_blocking_means_done_on_return):
        assert done == [True, True, True, True]
