"""Dropout under TP: RNGTracker's parallel and replicated streams, the block's and GPT's dropout
masks (replicated where the activations are, per rank under sequence parallelism), and activation
checkpointing that replays them."""
import pytest
import torch

from tplayers import BlockConfig, GPTConfig, ParallelGPT, ParallelTransformerBlock, RNGTracker
from tplayers.core.comm import gather_from_sequence
from tplayers.models.dense import DenseTransformerBlock
from tplayers.core.groups import resolve_group
from tplayers.testing import get_world

from _helpers import F64


def _rng_streams(group, seed):
    tracker = RNGTracker(seed, group=group)
    before = torch.get_rng_state()
    with tracker.fork("parallel"):
        par = torch.rand(4)
    with tracker.fork("replicated"):
        rep = torch.rand(4)
    with tracker.fork("parallel"):
        par2 = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork must leave the default generator as it was"
    assert not torch.equal(par, par2), "a stream advances across forks"
    again = RNGTracker(seed, group=group)
    with again.fork("parallel"):
        assert torch.equal(torch.rand(4), par), "reproducible from the seed"
    return par, rep


def test_rng_parallel_differs_across_ranks_replicated_agrees():
    (p0, r0), (p1, r1) = get_world(2).run(_rng_streams, 5)
    assert not torch.equal(p0, p1)
    assert torch.equal(r0, r1)


def test_nested_forks_continue_the_live_stream():
    """Megatron's double fork (tests/unit_tests/tensor_parallel/test_random.py): forks nested in any
    order draw what one fork per stream would draw in sequence, and leave each stream where it is;
    the caller's generator is untouched. (Before: an inner fork of a stream already forked replayed
    it from where the outer fork began: the same dropout mask twice.)"""
    double, single = RNGTracker(1234, group=None), RNGTracker(1234, group=None)
    before = torch.get_rng_state()
    one, two = [], []
    with double.fork("replicated"):
        one.append(torch.randn(10))
        with double.fork("parallel"):
            two.append(torch.randn(10))
            with double.fork("replicated"):
                one.append(torch.randn(10))
            two.append(torch.randn(10))
        one.append(torch.randn(10))
    assert torch.equal(torch.get_rng_state(), before)
    with single.fork("replicated"):
        want_one = [torch.randn(10) for _ in range(3)]
    with single.fork("parallel"):
        want_two = [torch.randn(10) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(one + two, want_one + want_two))
    for key, state in single.get_states().items():
        assert torch.equal(double.get_states()[key], state), key


def _block_dropout(group, config, sequence_parallel, use_checkpoint):
    """Train-mode block with dropout: per-rank outputs, and grads with or without checkpointing."""
    torch.manual_seed(0)
    dense = DenseTransformerBlock(config, dtype=F64)
    rng = RNGTracker(11, group=group)
    tp = ParallelTransformerBlock.from_dense(dense, group=group, sequence_parallel=sequence_parallel, rng=rng)
    tp.train()
    x = torch.randn(2, 4, config.hidden, dtype=F64)
    x = resolve_group(group).shard(x, 1).clone() if sequence_parallel else x
    x.requires_grad_()
    out = rng.checkpoint(tp, x) if use_checkpoint else tp(x)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in tp.named_parameters()}


def _block_sp_dropout_on_identical_shards(group):
    """Sequence-parallel block, non-causal, no rotary, residual dropout only, every rank fed the
    same token chunk: (outputs equal across ranks in eval mode, outputs equal in train mode)."""
    torch.manual_seed(0)
    config = BlockConfig(hidden=8, n_heads=4, ffn_hidden=8, causal=False, dropout=0.5)
    dense = DenseTransformerBlock(config, dtype=F64)
    tp = ParallelTransformerBlock.from_dense(dense, group=group, sequence_parallel=True,
                                             rng=RNGTracker(11, group=group))
    x = torch.randn(2, 2, 8, dtype=F64, generator=torch.Generator().manual_seed(1))  # this rank's (b, s/p, h)
    outs = []
    for train in (False, True):
        out = tp.train(train)(x)
        gathered = gather_from_sequence(out.detach(), group=group)  # (b, s, h): rank chunks back to back
        outs.append(torch.equal(*gathered.chunk(2, dim=1)))
    return outs


def test_block_dropout_replicated_agrees_and_checkpoint_replays():
    config = BlockConfig(hidden=8, n_heads=4, ffn_hidden=8, dropout=0.5, attn_dropout=0.5)
    world = get_world(2)
    plain = world.run(_block_dropout, config, False, False)
    # residual dropout is in the replicated region: both ranks hold the same output
    torch.testing.assert_close(plain[0][0], plain[1][0], rtol=0, atol=0)
    ckpt = world.run(_block_dropout, config, False, True)
    for (o, gx, gp), (o2, gx2, gp2) in zip(plain, ckpt):
        torch.testing.assert_close(o2, o, rtol=0, atol=0)
        torch.testing.assert_close(gx2, gx, rtol=0, atol=0)  # recomputed masks equal the original ones
        for name in gp:
            torch.testing.assert_close(gp2[name], gp[name], rtol=0, atol=0, msg=name)
    # under sequence parallelism each rank drops its own tokens: the masks differ across ranks
    # under sequence parallelism each rank drops its own tokens: the masks differ across ranks
    # (shown on identical shards, which a block without positions maps to identical outputs)
    same, dropped = world.run(_block_sp_dropout_on_identical_shards)[0]
    assert same and not dropped
    # and checkpointing replays those per-rank masks (parallel stream, sequence shards)
    sp = world.run(_block_dropout, config, True, True)
    sp_plain = world.run(_block_dropout, config, True, False)
    for (o, gx, gp), (o2, gx2, gp2) in zip(sp_plain, sp):
        torch.testing.assert_close(o2, o, rtol=0, atol=0)
        torch.testing.assert_close(gx2, gx, rtol=0, atol=0)
        for name in gp:
            torch.testing.assert_close(gp2[name], gp[name], rtol=0, atol=0, msg=name)


def _gpt_dropout_hidden(group):
    """ParallelGPT's final-norm input with embedding and residual dropout, train vs eval."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, hidden=8, n_heads=2, ffn_hidden=8, n_layers=1, dropout=0.5)
    model = ParallelGPT(config, group=group, rng=RNGTracker(3, group=group), dtype=F64)
    seen = []
    model.norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    ids = torch.randint(0, 11, (2, 4))
    model.train()(ids)
    model.eval()(ids)
    return seen


def test_gpt_embedding_dropout_is_replicated():
    (train0, eval0), (train1, eval1) = get_world(2).run(_gpt_dropout_hidden)
    torch.testing.assert_close(train0, train1, rtol=0, atol=0)  # same masks on both replicas
    assert not torch.equal(train0, eval0)  # and dropout did act


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rng_tracker_on_cuda_generator():
    tracker = RNGTracker(3, group=None)
    before = torch.cuda.get_rng_state()
    with tracker.fork("parallel", "cuda"):
        a = torch.rand(8, device="cuda")
    assert torch.equal(torch.cuda.get_rng_state(), before)
    with RNGTracker(3, group=None).fork("parallel", "cuda"):
        assert torch.equal(torch.rand(8, device="cuda"), a)
