"""The transformer block over batch chunks with its sublayers interleaved: equal to dense and to the
unchunked block, no drain between attention and MLP, used only where the pipeline applies, and
differentiable under create_graph."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tplayers
from tplayers import BlockConfig, ParallelTransformerBlock
from tplayers.models.dense import DenseTransformerBlock
from tplayers.testing import get_world

from conftest import examples
from _helpers import F64, MULTI_RANK, TP_SIZES, _check_block, configs


@pytest.mark.parametrize("tp", TP_SIZES)
@settings(max_examples=examples(4))  # 6 until stop 34 (the slowest property test: suite time)
@given(config=configs, batch=st.integers(2, 5), seq=st.sampled_from([4, 8]),
       mask_kind=st.sampled_from(["none", "bool", "float"]), sequence_parallel=st.booleans(),
       seed=st.integers(0, 2**16), chunks=st.sampled_from([2, 3, 8]), delay_wgrad=st.booleans(),
       main_grad=st.booleans())
def test_interleaved_block_matches_dense(tp, config, batch, seq, mask_kind, sequence_parallel, seed, chunks,
                                         delay_wgrad, main_grad):
    # chunks 8 > batch: one chunk per example; "float": a per-head additive mask, per example
    get_world(tp).run(_check_block, config, batch, seq, mask_kind, sequence_parallel, seed, chunks=chunks,
                      delay_wgrad=delay_wgrad, main_grad=main_grad)


_PIPELINE_CONFIG = BlockConfig(hidden=16, n_heads=4, ffn_hidden=32, n_kv_heads=2, activation="swiglu", norm="layernorm",
                               rotary=True)


def _interleaved_block_pipelines(group, sequence_parallel, chunks):
    """The interleaved block equals the unchunked one and the one chunked sublayer by sublayer to
    float64 rounding, with the same row collectives as the latter, and it does not drain between its
    sublayers: the (n+1)-th forward row collective (the MLP's first chunk) leaves before the n-th (the
    attention's last chunk) is waited on. Chunked sublayer by sublayer, the block waits first. (Under
    sequence parallelism the block does not use the pipeline, see its docstring; it is run directly.)"""
    p = group.size()
    torch.manual_seed(5)
    dense = DenseTransformerBlock(_PIPELINE_CONFIG, dtype=F64)
    with torch.no_grad():
        for name, param in dense.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.5)
    batch, seq = 5, 8 // (p if sequence_parallel else 1)
    x = torch.randn(batch, seq, 16, dtype=F64, generator=torch.Generator().manual_seed(group.rank() if sequence_parallel else 0))
    mask = (torch.rand(batch, 8, 8, generator=torch.Generator().manual_seed(9)) < 0.7) | torch.eye(8, dtype=torch.bool)
    results = {}
    for name, k, interleave in (("unchunked", 1, True), ("sublayers", chunks, False), ("interleaved", chunks, True)):
        block = ParallelTransformerBlock.from_dense(dense, group=group, sequence_parallel=sequence_parallel,
                                                    interleave_chunks=interleave)
        tplayers.set_overlap(block, chunks=k)
        xk = x.clone().requires_grad_()
        with tplayers.comm_accounting() as acct:
            if name == "interleaved" and sequence_parallel:  # the block chunks sublayer by sublayer under SP;
                assert p == 1 or not block._interleaves(xk, None)  # the pipeline itself is tested directly
                out = block._interleaved(xk, mask)
            else:
                out = block(xk, mask)
            (out * torch.arange(out.numel(), dtype=F64).reshape(out.shape).sin()).sum().backward()
        results[name] = ([out, xk.grad] + [param.grad for param in block.parameters()], acct.records)
    reference = results["unchunked"][0]
    for name in ("sublayers", "interleaved"):
        for want, got in zip(reference, results[name][0]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    row_op = "reduce_scatter" if sequence_parallel else "all_reduce"

    def rows(name, phase):
        return [r for r in results[name][1] if r.phase == phase and r.op == row_op]

    n = min(chunks, batch)
    if p > 1:  # (a world of one communicates nothing)
        assert len(rows("interleaved", "forward")) == len(rows("sublayers", "forward")) == 2 * n
        assert len(rows("interleaved", "backward")) == len(rows("sublayers", "backward"))

        def drains(name):  # the n-th forward collective waited on before the (n+1)-th leaves
            fwd = rows(name, "forward")
            return fwd[n - 1].wait_started <= fwd[n].launched

        assert drains("sublayers") and not drains("interleaved")
    return True


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_interleaved_block_equals_unchunked_and_does_not_drain_between_sublayers(tp, sequence_parallel):
    for chunks in (2, 3, 8):  # 8 > batch 5: one chunk per example
        assert all(get_world(tp).run(_interleaved_block_pipelines, sequence_parallel, chunks))


def _interleave_applies(group):
    """The block interleaves only where the pipeline holds and pays: chunks equal in both sublayers,
    no dropout in training, no KV cache, no sequence parallelism, ``interleave_chunks`` on."""
    rng = tplayers.RNGTracker(seed=1, group=group)
    dense = DenseTransformerBlock(BlockConfig(hidden=8, n_heads=2, ffn_hidden=8, dropout=0.1), dtype=F64)
    block = ParallelTransformerBlock.from_dense(dense, group=group, rng=rng)
    x = torch.zeros(2, 4, 8, dtype=F64)
    assert not block._interleaves(x, None)  # chunks 1
    tplayers.set_overlap(block, chunks=2)
    assert not block._interleaves(x, None)  # dropout, training
    block.eval()
    assert block._interleaves(x, None)
    assert not block._interleaves(x, object())  # a KV cache (generation)
    assert not block._interleaves(x.float(), None)  # wrong dtype: the sublayer path names it
    block.mlp.chunks = 3
    assert not block._interleaves(x, None)
    block.mlp.chunks, block.interleave_chunks = 2, False
    assert not block._interleaves(x, None)
    block.interleave_chunks, block.sequence_parallel = True, True
    assert not block._interleaves(x, None)  # its all-gathers would queue behind the reduce-scatters
    return True


def test_block_interleaves_only_where_the_pipeline_applies():
    assert all(get_world(2).run(_interleave_applies))


def _interleaved_first_order_under_create_graph(group):
    """create_graph=True through the interleaved block (the differentiable rebuild) gives dense's
    first-order gradients, themselves differentiable (the second order needs SDPA's double backward,
    which CPU torch does not have, dense or TP)."""
    torch.manual_seed(2)
    dense = DenseTransformerBlock(_PIPELINE_CONFIG, dtype=F64)
    block = ParallelTransformerBlock.from_dense(dense, group=group)
    tplayers.set_overlap(block, chunks=2)
    x = torch.randn(3, 8, 16, dtype=F64)
    grads = []
    for model in (dense, block):
        xi = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(model(xi).square().sum(), xi, create_graph=True)
        assert gx.requires_grad
        grads.append(gx.detach())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-10)
    return True


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_interleaved_block_under_create_graph_matches_dense(tp):
    assert all(get_world(tp).run(_interleaved_first_order_under_create_graph))


def _interleaved_saves_through_hooks(group):
    """What the pipeline keeps for backward (each chunk's residual input, norm output and column
    output) is saved with save_for_backward, so saved-tensor hooks (offloading, checkpointing tools)
    see it: an offload-to-a-copy hook still gives the same gradients, and the MLP's column outputs,
    (batch chunk, seq, 2 * ffn / p) under SwiGLU, are among what it packed."""
    p = group.size()
    torch.manual_seed(3)
    config = BlockConfig(hidden=16, n_heads=4, ffn_hidden=48, n_kv_heads=2, activation="swiglu")  # 2 * 48 / p: unique
    dense = DenseTransformerBlock(config, dtype=F64)
    block = ParallelTransformerBlock.from_dense(dense, group=group)
    tplayers.set_overlap(block, chunks=2)
    block.eval()  # the pipeline applies (no dropout in training)
    x = torch.randn(4, 8, 16, dtype=F64)
    grads, packed = [], []

    def pack(t):
        packed.append(tuple(t.shape))
        return t.detach().clone()  # as an offload would: the original is not what backward gets

    for hooks in (False, True):
        xi = x.clone().requires_grad_()
        assert block._interleaves(xi, None)
        if hooks:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = block(xi)
        else:
            out = block(xi)
        out.square().sum().backward()
        grads.append([xi.grad] + [q.grad.clone() for q in block.parameters()])
        block.zero_grad()
    same = all(torch.equal(a, b) for a, b in zip(*grads))
    return same, packed.count((2, 8, 2 * 48 // p))


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_interleaved_block_saves_through_saved_tensor_hooks(tp):
    for same, mlp_column_outputs in get_world(tp).run(_interleaved_saves_through_hooks):
        assert same and mlp_column_outputs == 2  # one per batch chunk
