"""delay_wgrad / backward_dw: weight gradients recorded during backward and run later are identical,
bit for bit, to the normal backward's (every layer kind, TP 2/4, sequence parallel on/off, replicated
KV heads, chunked regions, collective matmul, autocast, gradient accumulation). At TP 1 the normal path is plain
``F.linear`` (autograd's own linear backward), the delayed one tplayers' Function: equal to rounding."""
import pytest
import torch
import torch.nn as nn

import tplayers
from tplayers import (ColumnParallelLinear, FusedColumnParallelLinear, GPTConfig, ParallelAttention, ParallelGPT,
                      ParallelMLP, RowParallelLinear)
from tplayers.core.wgrad import ReplicatedRows
from tplayers.models.dense import DenseAttention, DenseGPT, DenseMLP
from tplayers.testing import get_world

from _helpers import F64


def _build(kind, group, sp):
    torch.manual_seed(0)
    p = group.size()
    if kind in ("column_cm", "row_cm"):  # collective matmul: ring steps (sequence parallel only; else left alone)
        layer = _build(kind[:-len("_cm")], group, sp)
        assert tplayers.set_overlap(layer, collective_matmul=True)["collective_matmul"] == int(sp)
        return layer
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
    if kind in ("attention", "attention_chunked", "attention_two_layer"):  # 2 KV heads: replicated at TP 4
        attn = ParallelAttention.from_dense(DenseAttention(16, 4, 2, None, True, True, True, dtype=F64), group=group,
                                            sequence_parallel=sp)
        tplayers.set_overlap(attn, split_backward=kind != "attention_two_layer",
                             chunks=2 if kind == "attention_chunked" else 1)
        return attn
    raise ValueError(kind)


def _input_dim(kind, group):
    # row: this rank's in/p features
    return {"row": 4, "row_cm": 4, "attention": 16, "attention_chunked": 16, "attention_two_layer": 16}.get(kind, 8)


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
    per_rank = sp or kind.startswith("row")
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
@pytest.mark.parametrize("kind", ["column", "row", "column_cm", "row_cm", "fused", "mlp", "mlp_chunked", "attention",
                                  "attention_two_layer"])
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


# ------------------------------------------------------------------ main_grad (fused accumulation)


def _main_grad_equals_grad(group, kind, sp, delay):
    """Weight-gradient GEMMs accumulating into main_grad buffers give what .grad accumulates over two
    microbatches; .grad of those parameters stays None; with delay_wgrad they fill at backward_dw."""
    x = torch.randn(2, 3, 4, _input_dim(kind, group), dtype=F64,
                    generator=torch.Generator().manual_seed(group.rank() if sp or kind.startswith("row") else 0))
    normal = _build(kind, group, sp)
    list(_step(normal, x, 2))
    fused = _build(kind, group, sp)
    assert tplayers.use_main_grad(fused, dtype=F64) >= 1
    tplayers.set_overlap(fused, delay_wgrad=delay)
    list(_step(fused, x, 2))
    for p in fused.parameters():
        assert p.grad is None, "a gradient reached .grad"
    if delay:
        assert all(not p.main_grad.any() for p in fused.parameters()) and tplayers.backward_dw(fused) >= 2
    for (name, a), b in zip(normal.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.main_grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)
    assert tplayers.main_grads_to_grads(fused) == len(list(fused.parameters()))
    assert all(p.grad is p.main_grad for p in fused.parameters())  # same dtype: handed over, not copied
    tplayers.zero_main_grads(fused)
    assert all(not p.main_grad.any() for p in fused.parameters())
    return True


@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("kind", ["column", "row", "row_cm", "fused", "mlp", "mlp_chunked", "attention",
                                  "attention_chunked", "attention_two_layer"])
def test_main_grad_accumulation_equals_the_grad_path(kind, sp, delay):
    # fused: one KV head, replicated on every rank; attention: 2 KV heads, replicated at TP 4 (split
    # region, chunked region, two-layer path): their rows' contributions must be summed over the replicas
    for tp in (1, 2, 4):
        assert all(get_world(tp).run(_main_grad_equals_grad, kind, sp and tp > 1, delay))


def _bf16_main_grad_is_more_exact(group):
    """bfloat16 weights, float32 main_grad: over 8 microbatches the buffer stays near the float64
    sum; bfloat16 .grad accumulation drifts further."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(32, 16 * group.size())
    layers = {name: ColumnParallelLinear.from_dense(dense, group=group).to(torch.bfloat16) for name in ("grad", "main")}
    tplayers.use_main_grad(layers["main"])
    reference = torch.zeros(layers["grad"].weight.shape, dtype=F64)
    for i in range(8):
        x = torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        grad_out = torch.randn(4, 64, 16, generator=torch.Generator().manual_seed(100 + i)).to(torch.bfloat16)
        for layer in layers.values():
            layer(x).backward(grad_out)
        reference += grad_out.double().flatten(0, 1).t() @ x.double().flatten(0, 1)
    main = layers["main"].weight.main_grad
    assert main.dtype == torch.float32 and layers["main"].weight.grad is None
    err_main = (main.double() - reference).abs().max().item()
    err_grad = (layers["grad"].weight.grad.double() - reference).abs().max().item()
    assert err_main < err_grad / 4, (err_main, err_grad)
    tplayers.main_grads_to_grads(layers["main"])
    assert layers["main"].weight.grad.dtype == torch.bfloat16  # cast once, for a bfloat16 optimizer
    return True


def test_bfloat16_weights_accumulate_their_gradient_in_float32():
    for tp in (1, 2):
        assert all(get_world(tp).run(_bf16_main_grad_is_more_exact))


def test_main_grad_refuses_bad_buffers():
    attn = ParallelAttention(16, 4, 1, group=None)
    assert tplayers.use_main_grad(attn) == 2
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="the weight's main_grad buffer is \\(3, 8\\)"):
        tplayers.column_parallel_linear(torch.randn(2, 8), w, None, group=None, main_grads=(torch.zeros(3, 8), None))
    with pytest.raises(ValueError, match="there is no bias"):
        tplayers.row_parallel_linear(torch.randn(2, 8), w, None, group=None, main_grads=(None, torch.zeros(4)))
    for runs in (((2, 5, (1,)),), ((2, 2, (1,)),), ((2, 4, (1,)), (1, 3, (1,)))):
        with pytest.raises(ValueError, match="replicated rows .* must be ordered, non-empty"):
            tplayers.column_parallel_linear(torch.randn(2, 8), w, None, group=None,
                                            main_grads=(ReplicatedRows(torch.zeros(4, 8), runs), None))
    for holders in ((2,), (1, 1), (0, 1), ()):  # refused before any collective: they do not cover one rank
        with pytest.raises(ValueError, match=r"holders=.* do not cover the TP group of 1 ranks"):
            tplayers.column_parallel_linear(torch.randn(2, 8), w, None, group=None,
                                            main_grads=(ReplicatedRows(torch.zeros(4, 8), ((0, 2, holders),)), None))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bfloat16_gemm_accumulates_in_float32_without_upcasting():
    from tplayers.core import wgrad

    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, 32, group=None, device="cuda", dtype=torch.bfloat16)
    tplayers.use_main_grad(layer)
    reference = torch.zeros(32, 64, dtype=F64, device="cuda")
    for i in range(8):
        x = torch.randn(4, 128, 64, device="cuda").to(torch.bfloat16)
        grad_out = torch.randn(4, 128, 32, device="cuda").to(torch.bfloat16)
        layer(x).backward(grad_out)
        reference += grad_out.double().flatten(0, 1).t() @ x.double().flatten(0, 1)
    assert wgrad._OUT_DTYPE_GEMM[0], "torch.mm(out_dtype=float32) was refused: fell back to upcasting"
    err = (layer.weight.main_grad.double() - reference).abs().max().item()
    assert err < 1e-3 * reference.abs().max().item(), err


def _hand_offs_forgotten(group):
    """Gradients that are not in ``.grad`` yet (delayed weight gradients, main_grad buffers) are never
    clipped, checked or stepped as if they were none: each call refuses, naming the hand-off."""
    errors = {}
    for mode in ("delay_wgrad", "main_grad"):
        torch.manual_seed(0)
        model = nn.Sequential(ColumnParallelLinear(8, 16, group=group), nn.GELU(), RowParallelLinear(16, 8, group=group))
        if mode == "delay_wgrad":
            tplayers.set_overlap(model, delay_wgrad=True)
        else:
            tplayers.use_main_grad(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 8)).square().sum().backward()
        for name, call in (("clip", lambda: tplayers.clip_grad_norm_(model, 1.0)),
                           ("replicas", lambda: tplayers.check_replicas(model)),
                           ("step", optimizer.step)):
            try:
                call()
                errors[mode, name] = ""
            except RuntimeError as e:
                errors[mode, name] = str(e)
        if mode == "delay_wgrad":
            tplayers.backward_dw(model)
        else:
            tplayers.main_grads_to_grads(model)
        tplayers.clip_grad_norm_(model, 1.0)  # handed off: everything runs
        optimizer.step()
    return errors


def test_clip_check_and_step_refuse_gradients_not_handed_off():
    """Before: clip_grad_norm_ with delayed weight gradients pending returned a norm without them (0.0 against
    a dense 12.4), the same with gradients still in main_grad; an optimizer step trained on without them."""
    for errors in get_world(2).run(_hand_offs_forgotten):
        for (mode, call), error in errors.items():
            fix = "tplayers.backward_dw(model)" if mode == "delay_wgrad" else "tplayers.main_grads_to_grads(model)"
            assert fix in error, (mode, call, error)
