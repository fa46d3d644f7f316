"""A converted Hugging Face gated MLP under sequence parallelism keeps its tokens rank-major between its GEMMs
(tplayers/convert/gated_mlp.py, tplayers/regions/gated.py): equal to the dense MLP (output, input gradient, every
parameter gradient, a double backward), and the module's own forward wherever something could see the tokens'
order (a hook on a projection) or the path does not apply."""
import copy

import pytest
import torch

import tplayers
from tplayers.testing import dense_parameters, get_world

from _helpers import Calls

pytest.importorskip("transformers")


def _mlp_pair(group, seed: int = 0, hidden: int = 16, ffn: int = 48, act: str = "silu", bias: bool = False):
    """``(dense LlamaMLP, its converted copy)``: the MLP of a 1-layer Llama parallelized with sequence parallelism."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, hidden_act=act, mlp_bias=bias)
    dense = LlamaForCausalLM(cfg).double()
    model = tplayers.parallelize(copy.deepcopy(dense), "auto", group=group, sequence_parallel=True, audit=False)
    return dense.model.layers[0].mlp, model.model.layers[0].mlp


def _row_calls():
    """Counts the calls of the kept path's row layer (rank_major_row_linear) in this process."""
    import tplayers.convert.gated_mlp as gated

    return Calls(gated, "rank_major_row_linear")


def _matches_dense(group, seed: int, batch: int, act: str, bias: bool, double: bool):
    g = tplayers.resolve_group(group)
    dense, mlp = _mlp_pair(group, seed, act=act, bias=bias)
    gen = torch.Generator().manual_seed(seed + 1)
    x_full = torch.randn(batch, 2 * g.size, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    x = x_full.detach().chunk(g.size, 1)[g.rank].clone().requires_grad_()  # this rank's sequence chunk
    weights = torch.randn(batch, 2 * g.size, 16, dtype=torch.float64, generator=gen)
    with _row_calls() as calls:
        out = mlp(x)
        loss = (out * weights.chunk(g.size, 1)[g.rank]).sum()
        if double:  # a gradient penalty: the input gradient's norm, differentiated again
            (grad_x,) = torch.autograd.grad(loss, x, create_graph=True)
            grad_x.square().sum().backward()
        else:
            loss.backward()
    out_d = dense(x_full)
    loss_d = (out_d * weights).sum()
    if double:
        (grad_d,) = torch.autograd.grad(loss_d, x_full, create_graph=True)
        grad_d.square().sum().backward()
    else:
        loss_d.backward()
        torch.testing.assert_close(x.grad, x_full.grad.chunk(g.size, 1)[g.rank], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, out_d.detach().chunk(g.size, 1)[g.rank], rtol=1e-10, atol=1e-10)
    grads = dense_parameters(mlp, grads=True)
    for name, p in dense.named_parameters():  # (no grad: the penalty does not depend on it, down_proj.bias)
        want = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(grads[name], want, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    return calls.n


@pytest.mark.parametrize("tp,batch,act,bias,double", [
    (2, 3, "silu", False, False),
    (4, 2, "gelu", True, False),
    (2, 1, "relu", False, False),   # one sequence: both orders are the same memory
    (2, 2, "silu", True, True),     # create_graph=True through the kept path
])
def test_a_converted_gated_mlp_keeps_its_tokens_rank_major_and_matches_dense(tp, batch, act, bias, double):
    assert get_world(tp).run(_matches_dense, 3, batch, act, bias, double) == [1] * tp


def _seen_by_hooks(group):
    """A forward hook on gate_proj (user code reading its output) and one on the MLP: the hook sees gate_proj's output
    in the sequence's order (the module's own forward runs), equal to the dense projection's."""
    g = tplayers.resolve_group(group)
    dense, mlp = _mlp_pair(group)
    x_full = torch.randn(2, 2 * g.size, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = x_full.chunk(g.size, 1)[g.rank].clone().requires_grad_()
    seen = []
    handle = mlp.gate_proj.register_forward_hook(lambda m, args, out: seen.append(out.detach()))
    try:
        with _row_calls() as calls:
            out = mlp(x)
            out.sum().backward()
    finally:
        handle.remove()
    want = dense.gate_proj(x_full).detach().chunk(g.size, -1)[g.rank]  # this rank's columns, the whole sequence
    torch.testing.assert_close(seen[0], want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, dense(x_full).detach().chunk(g.size, 1)[g.rank], rtol=1e-10, atol=1e-10)
    with _row_calls() as after:  # the hook removed: the kept path again
        mlp(x).sum().backward()
    return calls.n, after.n


def test_a_hook_on_a_projection_keeps_the_modules_own_forward():
    assert get_world(2).run(_seen_by_hooks) == [(0, 1)] * 2


def _no_grad_and_plain(group):
    """Under no_grad (no backward to come: the set's call is not made) the module's own forward runs; a plan
    without sequence parallelism gives the module no forward of its own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    g = tplayers.resolve_group(group)
    dense, mlp = _mlp_pair(group)
    x_full = torch.randn(2, 2 * g.size, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with _row_calls() as calls, torch.no_grad():
        out = mlp(x_full.chunk(g.size, 1)[g.rank])
    torch.testing.assert_close(out, dense(x_full).chunk(g.size, 1)[g.rank], rtol=1e-10, atol=1e-10)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)
    plain = tplayers.parallelize(LlamaForCausalLM(cfg), "auto", group=group, audit=False)
    return calls.n, "forward" in vars(mlp), "forward" in vars(plain.model.layers[0].mlp)


def test_without_a_backward_or_sequence_parallelism_the_modules_own_forward_runs():
    assert get_world(2).run(_no_grad_and_plain) == [(0, True, False)] * 2


def _hook_on_rank_zero(group):
    """A hook on rank 0's gate_proj only (logging on one rank): rank 0 runs the module's own forward, rank 1 the kept
    path. Their collectives carry the same data and the same fingerprints (the token order is a local choice), so
    with the collective checks on both give the dense MLP's values."""
    g = tplayers.resolve_group(group)
    dense, mlp = _mlp_pair(group)
    x_full = torch.randn(2, 2 * g.size, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                         requires_grad=True)
    x = x_full.detach().chunk(g.size, 1)[g.rank].clone().requires_grad_()
    if g.rank == 0:
        mlp.gate_proj.register_forward_hook(lambda m, args, out: None)
    with _row_calls() as calls:
        out = mlp(x)
        out.square().sum().backward()
    dense(x_full).square().sum().backward()
    torch.testing.assert_close(out, dense(x_full).detach().chunk(g.size, 1)[g.rank], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, x_full.grad.chunk(g.size, 1)[g.rank], rtol=1e-10, atol=1e-10)
    grads = dense_parameters(mlp, grads=True)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    return calls.n


def test_ranks_that_choose_different_token_orders_still_agree():
    assert get_world(2).run(_hook_on_rank_zero) == [0, 1]


def _sinks(group, mode: str):
    """main_grad buffers or delay_wgrad's recorded GEMMs through the kept path: the same gradients as the module's own
    forward (a hook on act_fn, which reads nothing, keeps the module's own)."""
    g = tplayers.resolve_group(group)
    dense, kept = _mlp_pair(group, bias=True)
    _, own = _mlp_pair(group, bias=True)
    own.act_fn.register_forward_hook(lambda m, args, out: None)
    x_full = torch.randn(3, 2 * g.size, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x = x_full.chunk(g.size, 1)[g.rank]
    grads = []
    for mlp in (kept, own):
        if mode == "main_grad":
            tplayers.use_main_grad(mlp, dtype=torch.float64)
        else:
            tplayers.set_overlap(mlp, delay_wgrad=True)
        with _row_calls() as calls:
            for _ in range(2):  # two microbatches accumulated
                mlp(x.clone().requires_grad_()).square().sum().backward()
        if mode == "main_grad":
            tplayers.main_grads_to_grads(mlp)
        else:
            assert all(p.grad is None for p in mlp.parameters())  # recorded, not computed yet
            tplayers.backward_dw(mlp)
        grads.append((calls.n, {n: p.grad.clone() for n, p in mlp.named_parameters()}))
    (n_kept, kept_grads), (n_own, own_grads) = grads
    for name, grad in own_grads.items():
        torch.testing.assert_close(kept_grads[name], grad, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    return n_kept, n_own


@pytest.mark.parametrize("mode", ["main_grad", "delay_wgrad"])
def test_main_grad_and_delay_wgrad_take_the_kept_paths_gradients(mode):
    assert get_world(2).run(_sinks, mode) == [(2, 0)] * 2


def _patched_after_parallelize(group):
    """User code replaces LlamaMLP.forward on the class after parallelize (a kernel library patching late, or a
    forward of its own): the converted MLP runs the patched forward, not the stock expression it was recognised by."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    g = tplayers.resolve_group(group)
    dense, mlp = _mlp_pair(group)
    x_full = torch.randn(2, 2 * g.size, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = x_full.chunk(g.size, 1)[g.rank].clone().requires_grad_()
    stock = LlamaMLP.forward

    def patched(self, x):  # the same layers, another function of them
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    LlamaMLP.forward = patched
    try:
        with _row_calls() as calls:
            out = mlp(x)
        want = patched(dense, x_full).detach().chunk(g.size, 1)[g.rank]
    finally:
        LlamaMLP.forward = stock
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    return calls.n


def test_a_forward_patched_on_the_class_after_parallelize_runs():
    assert get_world(2).run(_patched_after_parallelize) == [0, 0]
