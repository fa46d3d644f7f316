"""The overlap schedules of the MLP and attention regions: the split backward reorders the same
ops bit for bit, the chunked region (Domino-style) equals the unchunked one and overlaps its
forward collectives, chunks are validated, and one set_overlap switch sets a whole model."""
import pytest
import torch

import tplayers
from tplayers import GPTConfig, ParallelAttention, ParallelGPT, ParallelMLP
from tplayers.models.dense import DenseAttention, DenseMLP
from tplayers.testing import get_world

from _helpers import F64, MULTI_RANK


def _region_module(module, seed):
    """A dense MLP (activation ``module``; "narrow": gelu with ffn 16, whose per-rank sides at TP 4 are narrow
    enough for the sequence-parallel region to stay rank-major from one GEMM to the other) or attention (4 heads,
    2 KV heads: replicated at TP 4) of hidden 16, and its TP class."""
    torch.manual_seed(seed)
    if module == "attention":
        return DenseAttention(16, 4, 2, None, True, True, True, dtype=F64), ParallelAttention
    if module == "narrow":
        return DenseMLP(16, 16, "gelu", True, dtype=F64), ParallelMLP
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


@pytest.mark.parametrize("tp", MULTI_RANK)
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("module", ["gelu", "swiglu", "narrow", "attention"])  # MLP activations, and attention
def test_split_backward_is_bit_identical_to_the_two_layer_schedule(tp, module, sequence_parallel):
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


@pytest.mark.parametrize("tp", MULTI_RANK)
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("module", ["gelu", "swiglu", "attention"])
def test_chunked_region_equals_unchunked_and_overlaps_its_forward(tp, module, sequence_parallel):
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


def _gpt_overlap_switch(group):
    torch.manual_seed(0)
    dense = tplayers.models.dense.DenseGPT(GPTConfig(vocab_size=13, hidden=16, n_heads=4, n_kv_heads=2, ffn_hidden=32,
                                              n_layers=2, activation="swiglu", norm="rmsnorm")).double()
    ids = torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    for split in (False, True):
        model = ParallelGPT.from_dense(dense, group=group)
        counts = tplayers.set_overlap(model, split_backward=split, overlap_comm=True)
        assert counts == {"overlap_comm": 2 * 4 + 1, "split_backward": 4, "chunks": 0, "delay_wgrad": 0, "collective_matmul": 0}  # 4 linears per block + the head; MLP, attention
        model.loss(ids, ids.roll(-1, 1)).backward()
        grads.append([p.grad for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads))


def test_one_switch_sets_the_split_backward_of_a_whole_model_with_identical_gradients():
    assert all(get_world(2).run(_gpt_overlap_switch))
