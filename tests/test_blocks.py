"""ParallelMLP, ParallelAttention, ParallelTransformerBlock and ParallelGPT vs their dense twins."""
import pytest
import tplayers
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings

from conftest import examples
from hypothesis import strategies as st

from tplayers import (BlockConfig, VocabParallelEmbedding, GPTConfig, ParallelAttention, ParallelGPT, ParallelMLP, ParallelTransformerBlock,
                      RNGTracker)
from tplayers.core.comm import gather_from_sequence, scatter_to_sequence
from tplayers.models.dense import DenseAttention, DenseGPT, DenseMLP, DenseTransformerBlock
from tplayers.core.groups import TPGroup, resolve_group
from tplayers.layers import TensorParallelModule
from tplayers.testing import assert_matches_dense, dense_parameters, get_world

TP_SIZES = [1, 2, 4]
F64 = torch.float64


class _WithMask(nn.Module):
    """Binds an attention mask so assert_matches_dense sees a one-input module."""

    def __init__(self, inner, mask):
        super().__init__()
        self.inner, self.mask = inner, mask

    def forward(self, x):
        return self.inner(x, self.mask)


def _check_layouts(tp_module, dense_module, group):
    """Every TP child's param_placements() cuts exactly its local parameters from the dense ones."""
    g = resolve_group(group)
    dense_params = dict(dense_module.named_parameters())
    seen = 0
    for prefix, mod in tp_module.named_modules():
        if not isinstance(mod, TensorParallelModule):
            continue
        for name, layout in mod.param_placements().items():
            full = dense_params[f"{prefix}.{name}" if prefix else name]
            assert torch.equal(layout.shard(full, g.rank, g.size), getattr(mod, name)), f"{prefix}.{name}"
            seen += 1
    assert seen == len(dense_params), "every dense parameter has a layout"


def _make_mask(kind, batch, heads, seq, gen):
    if kind == "none":
        return None
    if kind == "bool":  # (b, s, s), every query keeps itself so no row is fully masked
        return (torch.rand(batch, seq, seq, generator=gen) < 0.7) | torch.eye(seq, dtype=torch.bool)
    return torch.randn(batch, heads, seq, seq, generator=gen, dtype=F64)  # additive, per head


def _io_dims(sequence_parallel):
    return dict(input_shard_dims=[1] if sequence_parallel else None, output_shard_dim=1 if sequence_parallel else None)


# ------------------------------------------------------------------ MLP


def _check_mlp(group, hidden, ffn, activation, bias, batch, seq, sequence_parallel, seed, split_backward=False,
               chunks=1, delay_wgrad=False):
    torch.manual_seed(seed)
    dense = DenseMLP(hidden, ffn, activation, bias, dtype=F64)
    tp = ParallelMLP.from_dense(dense, group=group, sequence_parallel=sequence_parallel, split_backward=split_backward,
                                chunks=chunks)
    tplayers.set_overlap(tp, delay_wgrad=delay_wgrad)
    _check_layouts(tp, dense, group)
    x = torch.randn(batch, seq, hidden, dtype=F64)
    return assert_matches_dense(tp, dense, x, group=group, **_io_dims(sequence_parallel)).grad_error


@settings(max_examples=examples(8))
@given(hidden=st.integers(1, 8), ffn_per_rank=st.integers(1, 3), activation=st.sampled_from(["gelu", "swiglu"]),
       bias=st.booleans(), batch=st.integers(1, 3), seq=st.sampled_from([4, 8]), sequence_parallel=st.booleans(),
       seed=st.integers(0, 2**16), split_backward=st.booleans(), chunks=st.sampled_from([1, 1, 2, 3]),
       delay_wgrad=st.booleans())
def test_mlp_matches_dense(hidden, ffn_per_rank, activation, bias, batch, seq, sequence_parallel, seed, split_backward,
                           chunks, delay_wgrad):
    for tp in TP_SIZES:
        get_world(tp).run(_check_mlp, hidden, ffn_per_rank * 4, activation, bias, batch, seq, sequence_parallel, seed,
                          split_backward, chunks, delay_wgrad)


def _region_module(module, seed):
    """A dense MLP (activation ``module``) or attention (4 heads, 2 KV heads: replicated at TP 4) of
    hidden 16, and its TP class."""
    torch.manual_seed(seed)
    if module == "attention":
        return DenseAttention(16, 4, 2, None, True, True, True, dtype=F64), ParallelAttention
    return DenseMLP(16, 32, module, True, dtype=F64), ParallelMLP


def _split_equals_megatron(group, module, sequence_parallel):
    """The split backward reorders the same ops: every gradient is bit-identical to the two-layer
    schedule's, and the collectives are the same (attention: 2 KV heads, replicated at TP 4)."""
    dense, cls = _region_module(module, seed=3)
    grads = []
    for split in (False, True):
        mlp = cls.from_dense(dense, group=group, sequence_parallel=sequence_parallel, split_backward=split)
        x = torch.randn(2, 8 // (group.size() if sequence_parallel else 1), 16, dtype=F64,
                        generator=torch.Generator().manual_seed(group.rank())).requires_grad_()
        with tplayers.comm_accounting() as acct:
            mlp(x).square().sum().backward()
        grads.append([x.grad] + [p.grad for p in mlp.parameters()])
        ops = sorted((r.op, r.phase) for r in acct.records)
        grads[-1].append(ops)
    assert grads[0][-1] == grads[1][-1], grads  # the same collectives
    return all(torch.equal(a, b) for a, b in zip(grads[0][:-1], grads[1][:-1]))


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("module", ["gelu", "swiglu", "attention"])  # MLP activations, and attention
def test_split_backward_is_bit_identical_to_the_two_layer_schedule(module, sequence_parallel):
    for tp in (2, 4):
        assert all(get_world(tp).run(_split_equals_megatron, module, sequence_parallel))


def _chunked_equals_unchunked(group, module, sequence_parallel, chunks):
    """The chunked region (Domino-style forward overlap) equals the unchunked one to float64
    rounding, issues one forward and one backward input-gradient collective per chunk, and launches
    chunk i+1's forward collective before it waits for chunk i's (the overlap itself, by order)."""
    dense, cls = _region_module(module, seed=5)
    batch, seq = 5, 8 // (group.size() if sequence_parallel else 1)
    x = torch.randn(batch, seq, 16, dtype=F64, generator=torch.Generator().manual_seed(group.rank()))
    mask = (torch.rand(batch, 1, 8, 8, generator=torch.Generator().manual_seed(9)) < 0.7) | torch.eye(8, dtype=torch.bool)
    results = []
    for k in (1, chunks):
        layer = cls.from_dense(dense, group=group, sequence_parallel=sequence_parallel, split_backward=True, chunks=k)
        xk = x.clone().requires_grad_()
        with tplayers.comm_accounting() as acct:
            out = layer(xk, mask) if module == "attention" else layer(xk)
            out.square().sum().backward()
        results.append(([out, xk.grad] + [p.grad for p in layer.parameters()], acct.records))
    (ref, ref_records), (got, records) = results
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    n = min(chunks, batch)
    row_op = "reduce_scatter" if sequence_parallel else "all_reduce"
    def ops(recs, phase):
        return [r for r in recs if r.phase == phase and r.op == row_op]

    fwd = ops(records, "forward")
    assert len(fwd) == n and len(ops(ref_records, "forward")) == 1, [(r.op, r.phase) for r in records]
    # backward: one input-gradient collective per chunk (attention at TP 4 adds the replicated KV
    # heads' gradient all-reduces, the same number in both)
    assert len(ops(records, "backward")) == len(ops(ref_records, "backward")) + n - 1
    if group.size() > 1:  # chunk 1's collective left before anyone waited on chunk 0's
        assert all(later.launched < fwd[0].wait_started for later in fwd[1:]), "forward collectives not overlapped"
    return True


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("module", ["gelu", "swiglu", "attention"])
def test_chunked_region_equals_unchunked_and_overlaps_its_forward(module, sequence_parallel):
    for tp in (2, 4):
        for chunks in (2, 3, 8):  # 8 > batch 5: one chunk per example
            assert all(get_world(tp).run(_chunked_equals_unchunked, module, sequence_parallel, chunks))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_chunks_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="chunks must be an integer >= 1"):
        ParallelMLP(8, 16, group=None, chunks=bad)
    with pytest.raises(ValueError, match="ParallelAttention: chunks"):
        ParallelAttention(8, 2, group=None, chunks=bad)
    with pytest.raises(ValueError, match="set_overlap: chunks"):
        tplayers.set_overlap(ParallelMLP(8, 16, group=None), chunks=bad)


# ------------------------------------------------------------------ attention

heads = st.sampled_from([(4, 4), (4, 2), (4, 1), (8, 2), (8, 8), (8, 4)])


def _check_attention(group, hidden, n_heads, n_kv, head_dim, causal, rotary, mask_kind, batch, seq,
                     sequence_parallel, seed, split_backward=False, chunks=1, delay_wgrad=False):
    torch.manual_seed(seed)
    dense = DenseAttention(hidden, n_heads, n_kv, head_dim, True, causal, rotary, dtype=F64)
    tp = ParallelAttention.from_dense(dense, group=group, sequence_parallel=sequence_parallel,
                                      split_backward=split_backward, chunks=chunks)
    tplayers.set_overlap(tp, delay_wgrad=delay_wgrad)
    _check_layouts(tp, dense, group)
    mask = _make_mask(mask_kind, batch, n_heads, seq, torch.Generator().manual_seed(seed))
    x = torch.randn(batch, seq, hidden, dtype=F64)
    return assert_matches_dense(_WithMask(tp, mask), _WithMask(dense, mask), x, group=group,
                                **_io_dims(sequence_parallel)).grad_error


def _check_key_padding_mask(group, kind, causal, sequence_parallel):
    """A (b, 1, 1, s) key-padding mask acts as the same mask expanded to (b, 1, s, s)."""
    torch.manual_seed(0)
    b, s = 2, 4
    dense = DenseAttention(8, 4, 2, causal=causal, dtype=F64)
    tp = ParallelAttention.from_dense(dense, group=group, sequence_parallel=sequence_parallel)
    keep = torch.tensor([[True, True, True, False], [True, False, True, True]])[:, None, None, :]  # (b, 1, 1, s)
    mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=F64).masked_fill(~keep, -1e4)
    x = torch.randn(b, s, 8, dtype=F64)
    assert_matches_dense(_WithMask(tp, mask), _WithMask(dense, mask.expand(b, 1, s, s)), x, group=group,
                         **_io_dims(sequence_parallel))


def test_attention_key_padding_mask_broadcasts_over_queries():
    for tp in (1, 2):
        for kind in ("bool", "float"):
            for causal in (False, True):
                get_world(tp).run(_check_key_padding_mask, kind, causal, tp == 2)


@settings(max_examples=examples(12))
@given(hidden=st.integers(1, 8), heads=heads, head_dim=st.sampled_from([2, 4]), causal=st.booleans(),
       rotary=st.booleans(), mask_kind=st.sampled_from(["none", "bool", "float"]), batch=st.integers(1, 3),
       seq=st.sampled_from([4, 8]), sequence_parallel=st.booleans(), seed=st.integers(0, 2**16),
       split_backward=st.booleans(), chunks=st.sampled_from([1, 1, 2, 3]), delay_wgrad=st.booleans())
def test_attention_matches_dense(hidden, heads, head_dim, causal, rotary, mask_kind, batch, seq, sequence_parallel,
                                 seed, split_backward, chunks, delay_wgrad):
    n_heads, n_kv = heads
    for tp in TP_SIZES:
        get_world(tp).run(_check_attention, hidden, n_heads, n_kv, head_dim, causal, rotary, mask_kind, batch, seq,
                          sequence_parallel, seed, split_backward, chunks, delay_wgrad)


def test_gqa_with_fewer_kv_heads_than_ranks_replicates_them():
    # 4 query heads, 1 KV head, 4 ranks: every rank holds the same KV head; its weight gradient is
    # the sum over all four ranks' query heads (checked against dense inside)
    get_world(4).run(_check_attention, 6, 4, 1, 2, True, True, "none", 2, 4, False, 7)
    get_world(4).run(_check_attention, 6, 8, 2, 2, False, False, "bool", 1, 4, True, 8)


# ------------------------------------------------------------------ block


def _check_block(group, config, batch, seq, mask_kind, sequence_parallel, seed, dtype=F64, chunks=1,
                 delay_wgrad=False, main_grad=False):
    torch.manual_seed(seed)
    dense = DenseTransformerBlock(config, dtype=dtype)
    with torch.no_grad():  # non-trivial norm weights, so their gradients are tested for real
        for name, p in dense.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    tp = ParallelTransformerBlock.from_dense(dense, group=group, sequence_parallel=sequence_parallel)
    tplayers.set_overlap(tp, chunks=chunks, delay_wgrad=delay_wgrad)
    if main_grad:
        tplayers.use_main_grad(tp, dtype=dtype)
    _check_layouts(tp, dense, group)
    assert type(tp.to_dense()) is DenseTransformerBlock
    mask = _make_mask(mask_kind, batch, config.n_heads, seq, torch.Generator().manual_seed(seed))
    x = torch.randn(batch, seq, config.hidden, dtype=dtype)
    return assert_matches_dense(_WithMask(tp, mask), _WithMask(dense, mask), x, group=group,
                                **_io_dims(sequence_parallel)).grad_error


def test_block_float32_within_default_tolerance():
    # fp32: only the order of the partial sums differs from dense (rtol 1e-4, atol 1e-5)
    config = BlockConfig(hidden=16, n_heads=4, ffn_hidden=32, n_kv_heads=2, activation="swiglu", norm="rmsnorm",
                         rotary=True)
    for tp in (2, 4):
        get_world(tp).run(_check_block, config, 2, 8, "bool", True, 1, torch.float32)


configs = st.builds(
    BlockConfig,
    hidden=st.integers(2, 8),
    n_heads=st.just(4),
    ffn_hidden=st.sampled_from([4, 8]),
    n_kv_heads=st.sampled_from([None, 1, 2]),
    head_dim=st.sampled_from([2, 4]),
    activation=st.sampled_from(["gelu", "swiglu"]),
    norm=st.sampled_from(["layernorm", "rmsnorm"]),
    bias=st.booleans(),
    causal=st.booleans(),
    rotary=st.booleans(),
)


@settings(max_examples=examples(8))
@given(config=configs, batch=st.integers(1, 2), seq=st.sampled_from([4, 8]),
       mask_kind=st.sampled_from(["none", "bool"]), sequence_parallel=st.booleans(), seed=st.integers(0, 2**16))
def test_block_matches_dense(config, batch, seq, mask_kind, sequence_parallel, seed):
    for tp in TP_SIZES:
        get_world(tp).run(_check_block, config, batch, seq, mask_kind, sequence_parallel, seed)


def _block_sp_equals_no_sp(group, config, seed):
    """The same block with and without sequence parallelism: equal outputs and gradients."""
    g = resolve_group(group)
    torch.manual_seed(seed)
    dense = DenseTransformerBlock(config, dtype=F64)
    x = torch.randn(2, 8, config.hidden, dtype=F64)
    results = []
    for sp in (False, True):
        tp = ParallelTransformerBlock.from_dense(dense, group=group, sequence_parallel=sp)
        xi = x.clone().requires_grad_()
        out = tp(scatter_to_sequence(xi, group=group) if sp else xi)
        out = gather_from_sequence(out, group=group, grad_is_partial=False) if sp else out
        (out * torch.arange(out.numel(), dtype=F64).reshape(out.shape).sin()).sum().backward()
        results.append((out.detach(), xi.grad, dense_parameters(tp, grads=True)))
    (o0, gx0, gp0), (o1, gx1, gp1) = results
    torch.testing.assert_close(o1, o0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx1, gx0, rtol=1e-12, atol=1e-12)
    for name in gp0:
        torch.testing.assert_close(gp1[name], gp0[name], rtol=1e-12, atol=1e-12, msg=name)
    return g.rank


def test_block_sequence_parallel_equals_tensor_parallel():
    config = BlockConfig(hidden=8, n_heads=4, ffn_hidden=8, n_kv_heads=2, activation="swiglu", norm="rmsnorm",
                         rotary=True)
    assert get_world(2).run(_block_sp_equals_no_sp, config, 3) == [0, 1]


# ------------------------------------------------------------------ block over batch chunks, interleaved


@settings(max_examples=examples(6))
@given(config=configs, batch=st.integers(2, 5), seq=st.sampled_from([4, 8]),
       mask_kind=st.sampled_from(["none", "bool", "float"]), sequence_parallel=st.booleans(),
       seed=st.integers(0, 2**16), chunks=st.sampled_from([2, 3, 8]), delay_wgrad=st.booleans(),
       main_grad=st.booleans())
def test_interleaved_block_matches_dense(config, batch, seq, mask_kind, sequence_parallel, seed, chunks, delay_wgrad,
                                         main_grad):
    # chunks 8 > batch: one chunk per example; "float": a per-head additive mask, per example
    for tp in TP_SIZES:
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


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_interleaved_block_equals_unchunked_and_does_not_drain_between_sublayers(sequence_parallel):
    for tp in TP_SIZES:
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


def test_interleaved_block_under_create_graph_matches_dense():
    for tp in (2, 4):
        assert all(get_world(tp).run(_interleaved_first_order_under_create_graph))


# ------------------------------------------------------------------ GPT


def _check_gpt(group, config, batch, seq, sequence_parallel, seed):
    torch.manual_seed(seed)
    dense = DenseGPT(config, dtype=F64)
    tp = ParallelGPT.from_dense(dense, group=group, sequence_parallel=sequence_parallel)
    _check_layouts(tp, dense, group)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    targets = torch.randint(0, config.vocab_size, (batch, seq))
    targets[0, 0] = -100
    tol = dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(tp.logits(ids), dense(ids), **tol)
    tp.zero_grad(set_to_none=True)
    loss, dense_loss = tp.loss(ids, targets), dense.loss(ids, targets)
    torch.testing.assert_close(loss, dense_loss, **tol)
    loss.backward()
    dense_loss.backward()
    grads = dense_parameters(tp, grads=True)
    assert set(grads) == {n for n, _ in dense.named_parameters()}
    for name, p in dense.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **tol, msg=name)
    return float(loss.detach())


@settings(max_examples=examples(4))
@given(vocab=st.integers(3, 13), activation=st.sampled_from(["gelu", "swiglu"]),
       norm=st.sampled_from(["layernorm", "rmsnorm"]), n_kv=st.sampled_from([1, 2, 4]), batch=st.integers(1, 2),
       sequence_parallel=st.booleans(), seed=st.integers(0, 2**16))
def test_gpt_logits_loss_and_grads_match_dense(vocab, activation, norm, n_kv, batch, sequence_parallel, seed):
    config = GPTConfig(hidden=8, n_heads=4, ffn_hidden=8, n_kv_heads=n_kv, activation=activation, norm=norm,
                       vocab_size=vocab, n_layers=2)
    for tp in TP_SIZES:
        losses = get_world(tp).run(_check_gpt, config, batch, 4, sequence_parallel, seed)
        assert len(set(losses)) == 1


# ------------------------------------------------------------------ dropout RNG


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


# ------------------------------------------------------------------ errors


def _fake_group(n, rank=0):
    """A TPGroup of size n for checks that fail before any communication."""
    return TPGroup(object(), rank, n)


def test_bad_inputs_raise_clear_errors():
    two = _fake_group(2)
    with pytest.raises(ValueError, match="ParallelAttention: n_heads=3 is not divisible by the TP degree 2"):
        ParallelAttention(12, 3, 3, 4, group=two)
    with pytest.raises(ValueError, match="n_kv_heads=3 is not divisible by the TP degree 2"):
        ParallelAttention(12, 6, 3, 4, group=two)
    with pytest.raises(ValueError, match="n_kv_heads=3 is fewer than the TP degree 4 and does not divide it"):
        ParallelAttention(12, 12, 3, 4, group=_fake_group(4))
    with pytest.raises(ValueError, match="n_heads=4 is not a multiple of n_kv_heads=3"):
        ParallelAttention(16, 4, 3, group=None)
    with pytest.raises(ValueError, match="needs rng="):
        ParallelTransformerBlock(BlockConfig(hidden=8, n_heads=2, ffn_hidden=8, dropout=0.1), group=two)
    with pytest.raises(ValueError, match=r"dropout=1.5 must be in \[0, 1\)"):  # the real problem, not the rng
        ParallelTransformerBlock(BlockConfig(hidden=8, n_heads=2, ffn_hidden=8, dropout=1.5), group=two)
    with pytest.raises(ValueError, match="ffn_hidden=5 is not divisible by the TP degree 2"):
        ParallelMLP(4, 5, group=two)
    # sequence parallelism: a sequence that does not split evenly is refused when it is scattered
    with pytest.raises(ValueError, match="size 3 is not divisible by the TP degree 2"):
        scatter_to_sequence(torch.randn(1, 3, 8), group=two)
    with pytest.raises(ValueError, match="sequence length .* not divisible by the TP degree 2"):
        VocabParallelEmbedding(8, 4, group=two, sequence_parallel=True, device="meta")(torch.zeros(1, 3, dtype=torch.long))
    attn = ParallelAttention(8, 2, group=None)
    with pytest.raises(ValueError, match="attn_mask of shape"):
        attn(torch.randn(1, 4, 8), torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"expected input \(batch, seq, hidden\)"):
        attn(torch.randn(4, 8))
    with pytest.raises(ValueError, match="last dim"):
        attn(torch.randn(1, 4, 7))
    with pytest.raises(ValueError, match="even head_dim"):
        ParallelAttention(6, 2, rotary=True, group=None)
    with pytest.raises(TypeError, match="DenseMLP"):
        ParallelMLP.from_dense(nn.Linear(2, 2), group=None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rng_tracker_on_cuda_generator():
    tracker = RNGTracker(3, group=None)
    before = torch.cuda.get_rng_state()
    with tracker.fork("parallel", "cuda"):
        a = torch.rand(8, device="cuda")
    assert torch.equal(torch.cuda.get_rng_state(), before)
    with RNGTracker(3, group=None).fork("parallel", "cuda"):
        assert torch.equal(torch.rand(8, device="cuda"), a)


# ------------------------------------------------------------------ activation memory


def _saved_activation_bytes(group, config, sequence_parallel, dense):
    """Unique non-parameter storages autograd saves in one block forward (see benchmarks/block_memory.py)."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, config.hidden)
    if dense:
        block = DenseTransformerBlock(config)
    else:
        block = ParallelTransformerBlock(config, group=group, sequence_parallel=sequence_parallel)
        x = scatter_to_sequence(x, group=group) if sequence_parallel else x
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x.detach().requires_grad_()).sum().backward()
    return sum(storages.values())


def test_sequence_parallel_saves_a_tp_share_of_activations():
    config = BlockConfig(hidden=32, n_heads=4, ffn_hidden=64, activation="swiglu", norm="rmsnorm", rotary=True)
    dense = get_world(1).run(_saved_activation_bytes, config, False, True)[0]
    for tp in (2, 4):
        per_rank = max(get_world(tp).run(_saved_activation_bytes, config, True, False))
        assert per_rank <= dense * 1.1 / tp, (tp, per_rank, dense)


def _column_sp_saved(group):
    from tplayers import ColumnParallelLinear
    g = resolve_group(group)
    layer = ColumnParallelLinear(8, 8, group=group, sequence_parallel=True)
    x = torch.randn(2, 4 // g.size, 8, requires_grad=True)  # this rank's sequence shard
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    assert out.shape == (2, 4, 8 // g.size), "the column linear all-gathers the sequence"
    acts = [t for t in saved if t.untyped_storage().data_ptr() != layer.weight.untyped_storage().data_ptr()]
    return [tuple(t.shape) for t in acts], all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                                               for t in acts)


def test_column_linear_under_sequence_parallelism_saves_only_the_input_shard():
    for shapes, is_input in get_world(2).run(_column_sp_saved):
        assert shapes == [(2, 2, 8)] and is_input  # not the gathered (2, 4, 8): re-gathered in backward


def test_norm_conversion_keeps_frozen_parameters_frozen():
    # like every other from_dense/to_dense: requires_grad follows the source parameter, bias included
    from tplayers.layers.norm import ParallelNorm
    dense = nn.LayerNorm(4)
    dense.bias.requires_grad_(False)
    tp = ParallelNorm.from_dense(dense, group=None)
    assert tp.weight.requires_grad and not tp.bias.requires_grad
    tp.weight.requires_grad_(False)
    back = tp.to_dense()
    assert not back.weight.requires_grad and not back.bias.requires_grad
    rms = ParallelNorm.from_dense(nn.RMSNorm(4), group=None)
    assert rms.bias is None and rms.weight.requires_grad and rms.to_dense().weight.requires_grad


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # the point of the test
def test_rmsnorm_default_eps_follows_the_input_dtype():
    # nn.RMSNorm(eps=None) uses the INPUT dtype's epsilon at call time; freezing the weight
    # dtype's (float32: 1.2e-7) changed the result for float64 (or autocast bf16) inputs
    from tplayers.layers.norm import ParallelNorm
    dense = nn.RMSNorm(4)
    tp = ParallelNorm.from_dense(dense, group=None)
    x = torch.full((2, 4), 1e-4, dtype=F64)
    torch.testing.assert_close(tp(x), dense(x))
    torch.testing.assert_close(tp.to_dense()(x), dense(x))
    with pytest.raises(ValueError, match="eps=None"):
        ParallelNorm(4, "layernorm", None, group=None)


def _gpt_overlap_switch(group):
    torch.manual_seed(0)
    dense = tplayers.models.dense.DenseGPT(GPTConfig(vocab_size=13, hidden=16, n_heads=4, n_kv_heads=2, ffn_hidden=32,
                                              n_layers=2, activation="swiglu", norm="rmsnorm")).double()
    ids = torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    for split in (False, True):
        model = ParallelGPT.from_dense(dense, group=group)
        counts = tplayers.set_overlap(model, split_backward=split, comm=True)
        assert counts == {"comm": 2 * 4 + 1, "split_backward": 4, "chunks": 0, "delay_wgrad": 0, "collective_matmul": 0}  # 4 linears per block + the head; MLP, attention
        model.loss(ids, ids.roll(-1, 1)).backward()
        grads.append([p.grad for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads))


def test_one_switch_sets_the_split_backward_of_a_whole_model_with_identical_gradients():
    assert all(get_world(2).run(_gpt_overlap_switch))
