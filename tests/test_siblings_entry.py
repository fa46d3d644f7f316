"""A declared set's entry (core/siblings.py, core/functional.py's _SetEntry) against the dense model in every way
a backward can run through it: plain, twice with retain_graph, a partial backward (x alone), create_graph (a
gradient penalty), float32-style main_grad buffers, delay_wgrad's recorded GEMMs, activation checkpointing, and
a member whose weight the entry did not take. float64, TP 2 and 4: each gradient within 1e-10 of dense's."""
import copy

import pytest
import torch

import tplayers
from tplayers.testing import dense_parameters, get_world
from test_comm_accounting import _Attention, _GatheredAttention  # q, k, v on one x; the same under SP


def _models(group):
    torch.manual_seed(0)
    h, f = 8, 4 * group.size()
    dense = _Attention(*[torch.nn.Linear(h, f) for _ in range(3)], torch.nn.Linear(f, h)).double()
    col = lambda m: tplayers.ColumnParallelLinear.from_dense(m, group=group)  # noqa: E731
    model = _Attention(col(dense.q), col(dense.k), col(dense.v), tplayers.RowParallelLinear.from_dense(dense.o, group=group))
    tplayers.declare_siblings(model.q, model.k, model.v)
    x = torch.randn(2, 6, h, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    return dense, model, x


def _loss(model, x):
    return model(x).square().sum()


def _grads(dense, model, x, run):
    """``run(module, x)`` on both (it leaves ``.grad`` on the parameters and x); the worst difference."""
    xd = x.detach().clone().requires_grad_()
    run(model, x)
    run(dense, xd)
    worst = float((x.grad - xd.grad).abs().max())
    got = dense_parameters(model, grads=True)
    for name, param in dense.named_parameters():
        worst = max(worst, float((got[name] - param.grad).abs().max()))
    return worst


def _twice(module, x):
    loss = _loss(module, x)
    loss.backward(retain_graph=True)
    loss.backward()


def _partial(module, x):
    (x.grad,) = torch.autograd.grad(_loss(module, x), [x])
    for param in module.parameters():  # (a partial backward leaves the parameters alone: dense's zeros compared)
        param.grad = torch.zeros_like(param)


def _penalty(module, x):
    (grad_x,) = torch.autograd.grad(_loss(module, x), [x], create_graph=True)
    grad_x.square().sum().backward()


def _checkpointed(module, x):
    torch.utils.checkpoint.checkpoint(_loss, module, x, use_reentrant=False).backward()


def _scenarios(group):
    out = {}
    for name, run in (("plain", lambda m, x: _loss(m, x).backward()), ("retain_graph twice", _twice),
                      ("partial backward", _partial), ("create_graph", _penalty), ("checkpoint", _checkpointed)):
        out[name] = _grads(*_models(group), run)
    dense, model, x = _models(group)
    tplayers.use_main_grad(model, dtype=torch.float64)
    untouched = []  # .grad stays None under main_grad (the entry returns None, not zeros, for what it added)

    def main_grad(m, x):
        _loss(m, x).backward()
        if m is model:
            untouched.extend(p.grad is None for p in model.parameters() if p is not model.o.bias)
            tplayers.main_grads_to_grads(model)
    out["main_grad"] = _grads(dense, model, x, main_grad)
    out["main_grad: a .grad written"] = float(not all(untouched))
    dense, model, x = _models(group)
    tplayers.set_overlap(model, delay_wgrad=True)
    out["delay_wgrad"] = _grads(dense, model, x, lambda m, x: (_loss(m, x).backward(), m is model
                                                                and tplayers.backward_dw(model)))
    dense, model, x = _models(group)  # k's weight read through a function: a new tensor at each read
    torch.nn.utils.parametrize.register_parametrization(model.k, "weight", _Scaled())
    xd = x.detach().clone().requires_grad_()
    _loss(model, x).backward()
    _loss(dense, xd).backward()
    mine = dense.k.weight.grad.chunk(group.size(), 0)[group.rank()]
    out["a weight the entry did not take"] = max(float((x.grad - xd.grad).abs().max()), float(
        (model.k.parametrizations.weight.original.grad - mine).abs().max()))
    return out


class _Scaled(torch.nn.Module):
    def forward(self, w):
        return w * 1.0


@pytest.mark.parametrize("tp", [2, 4])
def test_the_sets_entry_matches_dense_in_every_kind_of_backward(tp):
    for worst in get_world(tp).run(_scenarios):
        assert all(v < 1e-10 for v in worst.values()), worst


def _sequence_parallel_create_graph(group):
    """Under SP (the module gathers its sequence, the set takes the shard) with create_graph=True: the entry's
    differentiable reduce-scatter gives this rank's chunk of dense's input gradient."""
    torch.manual_seed(0)
    p, h, f = group.size(), 8, 4 * group.size()
    dense = _GatheredAttention(*[torch.nn.Linear(h, f) for _ in range(3)], torch.nn.Linear(f, h), None).double()
    col = lambda m: tplayers.ColumnParallelLinear.from_dense(m, group=group)  # noqa: E731
    row = tplayers.RowParallelLinear.from_dense(dense.o, group=group, sequence_parallel=True)
    model = _GatheredAttention(col(dense.q), col(dense.k), col(dense.v), row, group)
    xd = torch.randn(2, 2 * p, h, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x = xd.detach().chunk(p, 1)[group.rank()].clone().requires_grad_()
    (got,) = torch.autograd.grad(model(x).square().sum(), [x], create_graph=True)
    (want,) = torch.autograd.grad(dense(xd).square().sum(), [xd])
    return got.requires_grad, float((got - want.chunk(p, 1)[group.rank()]).abs().max())


@pytest.mark.parametrize("tp", [2, 4])
def test_the_sequence_parallel_entry_under_create_graph(tp):
    for differentiable, worst in get_world(tp).run(_sequence_parallel_create_graph):
        assert differentiable and worst < 1e-10, worst


def _entry_took(group):
    """The weights a call's entry takes: not one FSDP2 keeps sharded (a DTensor) until its member's pre-forward."""
    from torch.distributed.fsdp import fully_shard

    _, model, _ = _models(group)
    took = [w is m.weight for w, m in zip(model.q.siblings.entry_weights(), (model.q, model.k, model.v))]
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (group.size(),))
    fully_shard(model.k, mesh=mesh)
    return took, [id(w) for w in model.q.siblings.entry_weights()] == [id(model.q.weight), id(model.v.weight)]


def test_a_weight_fsdp2_keeps_sharded_is_left_to_its_member():
    for took, without_k in get_world(2).run(_entry_took):
        assert took == [True, True, True] and without_k


def test_copies_of_a_model_keep_their_own_sets():
    """A deep copy (an EMA model, an audit's twin) holds its own set, whose members are the copy's layers."""
    torch.manual_seed(0)
    cols = [tplayers.ColumnParallelLinear(8, 4, group=None) for _ in range(3)]
    model = _Attention(*cols, tplayers.RowParallelLinear(4, 8, group=None))
    tplayers.declare_siblings(model.q, model.k, model.v)
    other = copy.deepcopy(model)
    assert other.q.siblings is not model.q.siblings
    assert [m is n for m, n in zip(other.q.siblings.members, (other.q, other.k, other.v))] == [True] * 3


def _sp_models(group, f: int):
    """q, k, v (a set) and o under sequence parallelism: the columns gather the shard themselves (an MLP's
    gate / up), batch 2, so that the gathered sequence's rank-major order differs from the sequence's."""
    torch.manual_seed(0)
    p, h = group.size(), 8
    dense = _Attention(*[torch.nn.Linear(h, f) for _ in range(3)], torch.nn.Linear(f, h)).double()
    col = lambda m: tplayers.ColumnParallelLinear.from_dense(m, group=group, sequence_parallel=True)  # noqa: E731
    row = tplayers.RowParallelLinear.from_dense(dense.o, group=group, sequence_parallel=True)
    model = _Attention(col(dense.q), col(dense.k), col(dense.v), row)
    tplayers.declare_siblings(model.q, model.k, model.v)
    xd = torch.randn(2, 2 * p, h, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x = xd.detach().chunk(p, 1)[group.rank()].clone().requires_grad_()
    return dense, model, x, xd


def _sp_worst(group, dense, model, x, xd) -> float:
    p, r = group.size(), group.rank()
    worst = float((x.grad - xd.grad.chunk(p, 1)[r]).abs().max())
    got = dense_parameters(model, grads=True)
    for name, param in dense.named_parameters():
        worst = max(worst, float((got[name] - param.grad).abs().max()))
    return worst


def _sp_scenarios(group, f_per_rank: int):
    out = {}
    f = f_per_rank * group.size()
    for name, run in (("plain", lambda m, x: _loss(m, x).backward()), ("retain_graph twice", _twice),
                      ("checkpoint", _checkpointed)):
        dense, model, x, xd = _sp_models(group, f)
        run(model, x)
        run(dense, xd)
        out[name] = _sp_worst(group, dense, model, x, xd)
    dense, model, x, xd = _sp_models(group, f)
    tplayers.use_main_grad(model, dtype=torch.float64)
    _loss(model, x).backward()
    tplayers.main_grads_to_grads(model)
    _loss(dense, xd).backward()
    out["main_grad"] = _sp_worst(group, dense, model, x, xd)
    dense, model, x, xd = _sp_models(group, f)
    tplayers.set_overlap(model, delay_wgrad=True)
    _loss(model, x).backward()
    tplayers.backward_dw(model)
    _loss(dense, xd).backward()
    out["delay_wgrad"] = _sp_worst(group, dense, model, x, xd)
    dense, model, x, xd = _sp_models(group, f)  # k's weight read through a function: k computes its own gradient
    torch.nn.utils.parametrize.register_parametrization(model.k, "weight", _Scaled())
    _loss(model, x).backward()
    _loss(dense, xd).backward()
    p, r = group.size(), group.rank()
    mine, got = dense.k.weight.grad.chunk(p, 0)[r], model.k.parametrizations.weight.original.grad
    out["a weight the entry did not take"] = max(float((x.grad - xd.grad.chunk(p, 1)[r]).abs().max()),
                                                 float((got - mine).abs().max()))
    return out


@pytest.mark.parametrize("tp,f_per_rank", [(2, 2), (4, 2), (2, 8)])
def test_the_sequence_parallel_entry_matches_dense_in_every_kind_of_backward(tp, f_per_rank):
    """Under sequence parallelism, batch 2: the set's backward in either token order (narrow members: rank-major,
    3 x 2 features per rank against 8 in; wide: the sequence's). delay_wgrad recorded its weight gradients against a
    gather in the other order than the members' output gradients (6.4 off at TP 2 before)."""
    for worst in get_world(tp).run(_sp_scenarios, f_per_rank):
        assert all(v < 1e-10 for v in worst.values()), worst


def _backward_moves(group):
    """Bytes the set's backward and the row layer's move (the collective checks off: their copies aside), batch 2:
    the input reordered for the set's weight gradients and the summed input gradient's reduce-scatter, or each
    member's output gradient."""
    from tplayers.bench.counts import StepCounts

    before = tplayers.set_collective_checks(False)
    try:
        p, f = group.size(), 2 * group.size()
        _, model, x, _ = _sp_models(group, f)
        loss = _loss(model, x)
        with StepCounts() as counts:
            loss.backward()
        return counts.moved["clone"], x.shape, p
    finally:
        tplayers.set_collective_checks(before[0], timeout=before[1])


@pytest.mark.parametrize("tp", [2, 4])
def test_the_sequence_parallel_sets_backward_reorders_only_its_members_outputs(tp):
    """Issue 52: a set's backward under SP (q/k/v, gate/up: 3 x 2 features per rank, 8 in) reorders each member's
    output gradient (3 x 2 per token) instead of the whole input twice (2 x 8 per token); the row layer o (2 in
    per rank, 8 out) reorders its input gradient and its input (2 x 2)."""
    for moved, (b, s_p, h), p in get_world(tp).run(_backward_moves):
        tokens, itemsize = b * s_p * p, 8
        assert moved == tokens * (3 * 2 + 2 * 2) * itemsize, moved / (tokens * itemsize)


def _converted_llama_delayed(group):
    """HF Llama "auto" under SP (batch 2), `set_overlap(delay_wgrad=True)`: every gradient against dense's."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                                   num_hidden_layers=2, vocab_size=64, attn_implementation="sdpa", use_cache=False)
    dense = transformers.LlamaForCausalLM(cfg).double()
    model = tplayers.parallelize(copy.deepcopy(dense), "auto", group=group, sequence_parallel=True)
    tplayers.set_overlap(model, delay_wgrad=True)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    tplayers.backward_dw(model)
    dense(ids, labels=ids).loss.backward()
    got = dense_parameters(model, grads=True)
    return max(float((got[n] - p.grad).abs().max()) for n, p in dense.named_parameters())


@pytest.mark.parametrize("tp", [2, 4])
def test_a_converted_llama_under_sequence_parallelism_with_delay_wgrad_matches_dense(tp):
    """The wrong number above as users met it: the q/k/v and gate/up sets' recorded weight gradients 0.09-0.1 off
    dense's at TP 2 and 4 on main, with no error."""
    pytest.importorskip("transformers")
    for worst in get_world(tp).run(_converted_llama_delayed):
        assert worst < 1e-10, worst
