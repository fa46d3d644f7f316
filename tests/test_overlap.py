"""The overlap schedules of the MLP and attention regions: the split backward reorders the same
ops bit for bit, the chunked region (Domino-style) equals the unchunked one and overlaps its
forward collectives, chunks are validated, and one set_overlap switch sets a whole model."""
import pytest
import torch

import tplayers
from tplayers import GPTConfig, ParallelAttention, ParallelGPT, ParallelMLP
from tplayers.models.dense import DenseAttention, DenseMLP
from tplayers.testing import get_world

from _helpers import F64, MULTI_RANK, Timeline


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


def _megatron_schedule_keeps_rank_major(group, schedule, sink, width="narrow"):
    """Under SP the Megatron schedule's MLP (overlap on or off, or collective matmul's ring steps) runs as one region
    only to keep its tokens rank-major. With narrow per-rank sides (fc1 4 wide at TP 2 and 4 for hidden 16:
    `stays_rank_major`) every result is bit-identical to its two layers run one after the other; wide (fc1 32), where
    the layers would reorder some passes, equal to rounding (the GEMMs see the tokens in another order). The same
    collectives (ring steps included), and the two layers' order kept (fc2's weight gradient before fc1's collective
    leaves; fc1's under it with the overlap on)."""
    overlap_comm = schedule != "blocking"
    from tplayers.core import collectives

    torch.manual_seed(4)
    dense = DenseMLP(16, (4 if width == "narrow" else 16) * group.size(), "swiglu", True, dtype=F64)
    x = torch.randn(3, 8 // group.size(), 16, dtype=F64, generator=torch.Generator().manual_seed(group.rank()))
    results = []
    for path in ("region", "two layers"):
        mlp = ParallelMLP.from_dense(dense, group=group, sequence_parallel=True, overlap_comm=overlap_comm)
        tplayers.set_overlap(mlp, collective_matmul=schedule == "collective_matmul")
        assert mlp._keeps_rank_major()
        if sink == "main_grad":
            tplayers.use_main_grad(mlp, dtype=F64)
        tplayers.set_overlap(mlp, delay_wgrad=sink == "delay_wgrad")
        xk = x.clone().requires_grad_()
        out = mlp(xk) if path == "region" else mlp.fc2(mlp._act(mlp.fc1(xk)))
        timeline = Timeline({tuple(mlp.fc1.weight.shape): "fc1 wgrad", tuple(mlp.fc2.weight.shape): "fc2 wgrad"})
        previous = collectives.set_observer(timeline)
        try:
            with timeline.mode:
                out.square().sum().backward()
        finally:
            collectives.set_observer(previous)
        if sink == "delay_wgrad":
            assert tplayers.backward_dw(mlp) >= 1
        grads = [p.main_grad if sink == "main_grad" else p.grad for p in mlp.parameters()]
        results.append(([out, xk.grad, *grads], timeline.events))
    (region, region_events), (layers, layer_events) = results
    for name, a, b in zip(["output", "input grad", *(n for n, _ in mlp.named_parameters())], region, layers):
        if width == "wide":
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13, msg=name)
        else:
            assert torch.equal(a, b), f"{name}: the region differs from the two layers by {(a - b).abs().max()}"
    launches = [e for e in region_events if e.startswith("launch")]
    assert launches == [e for e in layer_events if e.startswith("launch")], (region_events, layer_events)
    assert ("launch send" in launches) == (schedule == "collective_matmul"), launches
    if sink != "delay_wgrad":
        rs = region_events.index("launch reduce_scatter")
        assert region_events.index("fc2 wgrad") < rs < region_events.index("fc1 wgrad"), region_events
        if overlap_comm:
            assert region_events.index("fc1 wgrad") < region_events.index("wait reduce_scatter"), region_events
    return True


@pytest.mark.parametrize("tp", MULTI_RANK)
@pytest.mark.parametrize("schedule", ["overlap", "blocking", "collective_matmul"])
@pytest.mark.parametrize("sink", ["grad", "main_grad", "delay_wgrad"])
def test_the_megatron_schedule_keeps_the_mlp_rank_major_with_its_two_layers_bits(tp, schedule, sink):
    assert all(get_world(tp).run(_megatron_schedule_keeps_rank_major, schedule, sink))


@pytest.mark.parametrize("tp", MULTI_RANK)
@pytest.mark.parametrize("schedule", ["overlap", "collective_matmul"])
def test_a_wide_mlp_keeps_its_tokens_rank_major_too(tp, schedule):
    assert all(get_world(tp).run(_megatron_schedule_keeps_rank_major, schedule, "grad", "wide"))


def _observed_layers_run_as_they_are(group):
    """A hook on fc1 sees its output in the sequence's order (the two layers run as they are): what dense's fc1 gives
    for the whole sequence, this rank's columns. tp_invariant layers compute their own fixed tree."""
    torch.manual_seed(4)
    dense = DenseMLP(16, 4 * group.size(), "gelu", True, dtype=F64)
    x = torch.randn(3, 8, 16, dtype=F64, generator=torch.Generator().manual_seed(0))
    mlp = ParallelMLP.from_dense(dense, group=group, sequence_parallel=True)
    assert mlp._keeps_rank_major()
    seen = []
    mlp.fc1.register_forward_hook(lambda m, args, out: seen.append(out.detach()))
    assert not mlp._keeps_rank_major()
    p, r = group.size(), group.rank()
    mlp(x.chunk(p, dim=1)[r].clone())
    torch.testing.assert_close(seen[0], dense.fc1(x).chunk(p, dim=-1)[r], rtol=1e-12, atol=1e-12)
    plain = ParallelMLP.from_dense(dense, group=group, sequence_parallel=True)
    plain.fc1.tp_invariant = True
    return not plain._keeps_rank_major()


def test_a_hooked_mlp_layer_sees_the_sequence_order():
    assert all(get_world(2).run(_observed_layers_run_as_they_are))


def test_a_region_refuses_chunks_it_cannot_run():
    """Chunks need the split backward (each chunk's collective runs under the next chunk's backward); collective
    matmul's ring steps have no chunked form and exist under sequence parallelism only."""
    from tplayers.regions.region import split_backward_region

    x, w1, w2 = torch.randn(4, 2, 8), torch.randn(6, 8), torch.randn(8, 6)
    args = (x, w1, None, w2, None, lambda h, rows: h)
    with pytest.raises(ValueError, match="chunks=2 needs split_backward=True"):
        split_backward_region(*args, group=None, chunks=2, split_backward=False)
    with pytest.raises(ValueError, match="collective_matmul needs sequence_parallel=True and one chunk"):
        split_backward_region(*args, group=None, collective_matmul=True)
    with pytest.raises(ValueError, match=r"collective_matmul needs .* \(got sequence_parallel=True, chunks=2\)"):
        split_backward_region(*args, group=None, sequence_parallel=True, chunks=2, collective_matmul=True)


def _rank_major_mlp_as_users_run_it(group):
    """The Megatron schedule's rank-major MLP region (narrow SP MLP) under what users wrap around it: activation
    checkpointing, a second backward through a retained graph, a differentiable backward (create_graph), an input
    that needs no gradient, and inference mode: each bit-identical to its two layers run one after the other (the
    differentiable backward's second one to rounding: it runs through the layers' differentiable ops in its own
    order). Checkpointed, the MLP's forward runs twice, not three times (a backward nested in the region's, through a
    graph kept from forward, would recompute the checkpointed forward again)."""
    torch.manual_seed(6)
    dense = DenseMLP(16, 4 * group.size(), "gelu", True, dtype=F64)
    mlp = ParallelMLP.from_dense(dense, group=group, sequence_parallel=True)
    assert mlp._keeps_rank_major()
    layers = lambda t: mlp.fc2(mlp._act(mlp.fc1(t)))  # noqa: E731
    x = torch.randn(2, 8 // group.size(), 16, dtype=F64, generator=torch.Generator().manual_seed(group.rank()))

    def run(fn, how):
        mlp.zero_grad(set_to_none=True)
        xk = x.clone().requires_grad_(how != "no input grad")
        if how == "inference":
            with torch.inference_mode():
                return [fn(xk).clone()]
        out = torch.utils.checkpoint.checkpoint(fn, xk, use_reentrant=False) if how == "checkpoint" else fn(xk)
        if how == "create_graph":
            (gx,) = torch.autograd.grad(out.square().sum(), xk, create_graph=True)
            gx.square().sum().backward()
        elif how == "retain_graph":
            out.square().sum().backward(retain_graph=True)
            out.sum().backward()
        else:
            out.square().sum().backward()
        return [out.detach(), xk.grad, *(p.grad for p in mlp.parameters())]

    calls = []
    mlp.register_forward_pre_hook(lambda m, args: calls.append(1))
    run(mlp, "checkpoint")
    assert len(calls) == 2, f"the checkpointed MLP ran its forward {len(calls)} times"
    for how in ("checkpoint", "retain_graph", "create_graph", "no input grad", "inference"):
        for a, b in zip(run(mlp, how), run(layers, how)):
            if how == "create_graph" and a is not None:
                torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13, msg=how)
            else:
                assert (a is None and b is None) or torch.equal(a, b), how
    return True


def test_the_rank_major_mlp_region_under_checkpointing_and_higher_order_backward():
    for tp in MULTI_RANK:
        assert all(get_world(tp).run(_rank_major_mlp_as_users_run_it))


def _regions_under_activation_checkpointing(group, chunks):
    """A block whose attention and MLP run as regions (split backward; chunks: the block pipeline), under
    ``RNGTracker.checkpoint`` and under torch's non-reentrant checkpoint: the block's forward runs twice (forward and
    the checkpoint's recompute), not three times, and the results equal the unwrapped block's. The attention's
    region keeps its core's graph from forward, but not under saved-tensor hooks: there a backward nested through
    that graph unpacked the checkpoint's placeholders in a graph task of its own, so the checkpoint ran the block's
    forward again, and the tracker's single-use contexts raised AttributeError."""
    from tplayers import BlockConfig, ParallelTransformerBlock
    from tplayers.models.dense import DenseTransformerBlock
    from tplayers.models.rng import RNGTracker

    torch.manual_seed(0)
    dense = DenseTransformerBlock(BlockConfig(hidden=16, n_heads=4, n_kv_heads=2, ffn_hidden=32), dtype=F64)
    rng = RNGTracker(11, group=group)
    block = ParallelTransformerBlock.from_dense(dense, group=group, rng=rng)
    tplayers.set_overlap(block, split_backward=True, chunks=chunks)
    calls = []
    block.register_forward_pre_hook(lambda m, args, *kw: calls.append(1))
    x = torch.randn(2, 4, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
    results = []
    for wrap in (None, rng.checkpoint, lambda fn, t: torch.utils.checkpoint.checkpoint(fn, t, use_reentrant=False)):
        block.zero_grad(set_to_none=True)
        xk = x.clone().requires_grad_()
        calls.clear()
        out = block(xk) if wrap is None else wrap(block, xk)
        out.square().sum().backward()
        assert len(calls) == (1 if wrap is None else 2), f"the block ran its forward {len(calls)} times"
        results.append([out.detach(), xk.grad, *(p.grad for p in block.parameters())])
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    return True


@pytest.mark.parametrize("chunks", [1, 2])
def test_regions_under_activation_checkpointing_run_their_forward_once_more(chunks):
    assert all(get_world(2).run(_regions_under_activation_checkpointing, chunks))
