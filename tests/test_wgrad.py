"""delay_wgrad / backward_dw: weight gradients recorded during backward and run later are identical,
bit for bit, to the normal backward's (every layer kind, TP 2/4, sequence parallel on/off, replicated
KV heads, chunked regions, autocast, gradient accumulation). At TP 1 the normal path is plain
``F.linear`` (autograd's own linear backward), the delayed one tplayers' Function: equal to rounding."""
import pytest
import torch

import tplayers
from tplayers import (ColumnParallelLinear, FusedColumnParallelLinear, GPTConfig, ParallelAttention, ParallelGPT,
                      ParallelMLP, RowParallelLinear)
from tplayers.dense import DenseAttention, DenseGPT, DenseMLP
from tplayers.testing import get_world

F64 = torch.float64


def _build(kind, group, sp):
    torch.manual_seed(0)
    p = group.size()
    if kind == "column":
        return ColumnParallelLinear.from_dense(torch.nn.Linear(8, 4 * p, dtype=F64), group=group, sequence_parallel=sp)
    if kind == "row":
        return RowParallelLinear.from_dense(torch.nn.Linear(4 * p, 8, dtype=F64), group=group, sequence_parallel=sp)
    if kind == "fused":  # q, k, v with a single KV head: replicated on every rank at TP > 1
        return FusedColumnParallelLinear.from_dense(torch.nn.Linear(8, 4 * p + 4, dtype=F64), group=group,
                                                    parts=[4 * p, 2, 2], part_shards=[p, 1, 1], sequence_parallel=sp)
    if kind in ("mlp", "mlp_chunked"):
        mlp = ParallelMLP.from_dense(DenseMLP(8, 8 * p, "swiglu", True, dtype=F64), group=group, sequence_parallel=sp)
        tplayers.set_overlap(mlp, split_backward=True, chunks=3 if kind == "mlp_chunked" else 1)
        return mlp
    if kind in ("attention", "attention_two_layer"):  # 2 KV heads: replicated at TP 4
        attn = ParallelAttention.from_dense(DenseAttention(16, 4, 2, None, True, True, True, dtype=F64), group=group,
                                            sequence_parallel=sp)
        tplayers.set_overlap(attn, split_backward=kind == "attention")
        return attn
    raise ValueError(kind)


def _input_dim(kind, group):
    return {"row": 4, "attention": 16, "attention_two_layer": 16}.get(kind, 8)  # row: this rank's in/p features


def _same(a, b, group):
    if group.size() == 1:  # F.linear's backward vs the Function's GEMMs: equal up to float64 rounding
        return torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    return torch.equal(a, b)


def _step(layer, x, microbatches):
    for i in range(microbatches):
        xi = x[i].clone().requires_grad_()
        layer(xi).sin().sum().backward()
        yield xi.grad


def _delayed_equals_normal(group, kind, sp, microbatches):
    # (microbatches, b, s, in): 4 tokens per rank; a rank's own chunk (sequence parallel, or the row
    # layer's feature shard) differs per rank, a replicated input does not
    per_rank = sp or kind == "row"
    x = torch.randn(microbatches, 3, 4, _input_dim(kind, group), dtype=F64,
                    generator=torch.Generator().manual_seed(group.rank() if per_rank else 0))
    normal = _build(kind, group, sp)
    normal_dx = list(_step(normal, x, microbatches))
    delayed = _build(kind, group, sp)
    counts = tplayers.set_overlap(delayed, delay_wgrad=True)
    assert counts["delay_wgrad"] >= 1
    delayed_dx = list(_step(delayed, x, microbatches))
    assert tplayers.pending_wgrad(delayed) >= microbatches
    assert all(prm.grad is None for prm in delayed.parameters()), "a weight gradient was computed in backward"
    assert all(_same(a, b, group) for a, b in zip(normal_dx, delayed_dx)), "input gradients differ"
    ran = tplayers.backward_dw(delayed)
    assert ran >= microbatches and tplayers.pending_wgrad(delayed) == 0
    for (name, a), b in zip(normal.named_parameters(), delayed.parameters()):
        assert b.grad is not None and _same(a.grad, b.grad, group), name
    return True


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("kind", ["column", "row", "fused", "mlp", "mlp_chunked", "attention", "attention_two_layer"])
def test_delayed_weight_gradients_equal_the_normal_backward_bit_for_bit(kind, sp):
    for tp in (1, 2, 4):
        assert all(get_world(tp).run(_delayed_equals_normal, kind, sp and tp > 1, 2))


def _gpt_delayed(group, sp):
    torch.manual_seed(0)
    dense = DenseGPT(GPTConfig(vocab_size=13, hidden=16, n_heads=4, n_kv_heads=2, ffn_hidden=32, n_layers=2,
                               activation="swiglu", norm="rmsnorm")).double()
    ids = torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    for delay in (False, True):
        model = ParallelGPT.from_dense(dense, group=group, sequence_parallel=sp)
        tplayers.set_overlap(model, split_backward=True, delay_wgrad=delay)
        model.loss(ids, ids.roll(-1, 1)).backward()
        if delay:
            assert tplayers.backward_dw(model) > 0
        grads.append([prm.grad for prm in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("sp", [False, True])
def test_a_whole_gpt_with_delayed_weight_gradients_has_the_same_gradients(sp):
    for tp in (2, 4):
        assert all(get_world(tp).run(_gpt_delayed, sp))


def _autocast_delayed(group):
    grads = []
    for delay in (False, True):
        torch.manual_seed(0)
        layer = ColumnParallelLinear.from_dense(torch.nn.Linear(8, 4 * group.size()), group=group, delay_wgrad=delay)
        x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(3))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        out.float().square().sum().backward()
        tplayers.backward_dw(layer)
        assert layer.weight.grad.dtype == torch.float32  # through autocast's cast, as the normal path
        grads.append((layer.weight.grad, layer.bias.grad))
    return all(_same(a, b, group) for a, b in zip(*grads))


def test_delayed_weight_gradients_under_autocast_reach_the_float32_parameters():
    for tp in (2, 4):  # (TP 1 compares bfloat16 F.linear with the Function's GEMMs: not bitwise)
        assert all(get_world(tp).run(_autocast_delayed))


def test_turning_delay_off_with_work_pending_is_refused():
    layer = ColumnParallelLinear(4, 4, group=None, delay_wgrad=True)
    layer(torch.randn(2, 4)).sum().backward()
    assert layer.weight.grad is None and tplayers.pending_wgrad(layer) == 1
    with pytest.raises(RuntimeError, match="1 recorded weight-gradient computations not run yet"):
        tplayers.set_overlap(layer, delay_wgrad=False)
    assert tplayers.backward_dw(layer) == 1 and layer.weight.grad is not None
    assert tplayers.set_overlap(layer, delay_wgrad=False)["delay_wgrad"] == 1


def test_frozen_weights_record_nothing():
    layer = RowParallelLinear(4, 4, group=None, delay_wgrad=True)
    layer.requires_grad_(False)
    x = torch.randn(2, 4, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and tplayers.pending_wgrad(layer) == 0
