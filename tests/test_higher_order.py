"""Second derivatives (``create_graph=True``) through the TP autograd Functions, against dense.

The comm Functions and the fused linear Functions are differentiable twice (a gradient penalty, a
Hessian-vector product); the vocab-parallel loss is not, and says so when a second backward
reaches it, even where ``once_differentiable`` would have let a wrong number through (an incoming
gradient that does not require grad: ``loss.backward()``'s 1, or a critic linear in its output).
"""
import pytest
import torch
import torch.nn as nn

import tplayers
from tplayers.core.comm import gather_from_sequence, reduce_from_tp, scatter_to_sequence, sum_over_replicas
from tplayers.testing import dense_parameters, get_world

from _helpers import F64, MULTI_RANK


class _MLP(nn.Module):
    """up -> tanh -> down, dense or TP (layout "gathered": gather_output=True into input_is_parallel=False); under sequence parallelism the input is scattered along the
    sequence and the output gathered back, so both take and return the full replicated tensor."""

    def __init__(self, up, down, group=None, sp=False):
        super().__init__()
        self.up, self.down, self.group, self.sp = up, down, group, sp

    def forward(self, x):
        if self.group is None:
            return self.down(torch.tanh(self.up(x)))
        h = scatter_to_sequence(x, group=self.group) if self.sp else x
        y = self.down(torch.tanh(self.up(h)))
        return gather_from_sequence(y, group=self.group, grad_is_partial=False) if self.sp else y


def _build(group, sp, layout):
    torch.manual_seed(0)
    up, down = nn.Linear(8, 16, dtype=F64), nn.Linear(16, 8, dtype=F64)
    dense = _MLP(up, down)
    opts = dict(gather_output=True) if layout == "gathered" else dict(sequence_parallel=sp)
    col = tplayers.ColumnParallelLinear.from_dense(up, group=group, **opts)
    opts = dict(input_is_parallel=False) if layout == "gathered" else dict(sequence_parallel=sp)
    row = tplayers.RowParallelLinear.from_dense(down, group=group, **opts)
    return dense, _MLP(col, row, group, sp)


def _penalty(model, x, loss):
    """A gradient penalty: ||d loss(model(x)) / dx||^2, backpropagated into x and the parameters."""
    x = x.clone().requires_grad_()
    y = model(x)
    (gx,) = torch.autograd.grad(y.sum() if loss == "linear" else y.pow(2).sum(), x, create_graph=True)
    gx.pow(2).sum().backward()
    return x.grad


def _mlp_penalty(group, sp, layout, loss):
    dense, tp = _build(group, sp, layout)
    x = torch.randn(2, 4, 8, dtype=F64)
    gx_dense, gx_tp = _penalty(dense, x, loss), _penalty(tp, x, loss)
    errors = {"x": float((gx_dense - gx_tp).abs().max())}
    for name in ("up", "down"):
        want = dict(getattr(dense, name).named_parameters())
        got = dense_parameters(getattr(tp, name), grads=True)
        for pname, p in want.items():  # no grad: the penalty does not depend on it (down.bias)
            want_grad = torch.zeros_like(p) if p.grad is None else p.grad
            errors[f"{name}.{pname}"] = float((got[pname] - want_grad).abs().max())
    assert float(gx_dense.abs().max()) > 1e-3  # the penalty's gradient is not trivially zero
    return errors


@pytest.mark.parametrize("tp", MULTI_RANK)
@pytest.mark.parametrize("sp, layout", [(False, "mlp"), (True, "mlp"), (False, "gathered")])
@pytest.mark.parametrize("loss", ["square", "linear"])
def test_gradient_penalty_through_parallel_linears_matches_dense(tp, sp, layout, loss):
    """loss="linear" is a WGAN critic: the output gradient is a constant, which once_differentiable
    did not mark, so the second derivative silently lost the weight's term."""
    for errors in get_world(tp).run(_mlp_penalty, sp, layout, loss):
        assert max(errors.values()) < 1e-10, errors


def _critic_penalty(group):
    """A one-layer WGAN critic: its output gradient is a constant, so once_differentiable attached no
    error and the penalty's gradient silently lost the weight's term (rank-dependent wrong numbers)."""
    torch.manual_seed(0)
    dense = nn.Linear(8, 1, dtype=F64)
    tp = tplayers.RowParallelLinear.from_dense(dense, group=group, input_is_parallel=False)
    x = torch.randn(3, 8, dtype=F64)
    for model in (dense, tp):
        xi = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(model(xi).sum(), xi, create_graph=True)
        (gx.pow(2).sum() + model.weight.pow(2).sum()).backward()
    return float((dense_parameters(tp, grads=True)["weight"] - dense.weight.grad).abs().max())


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_gradient_penalty_of_a_linear_critic_matches_dense(tp):
    assert max(get_world(tp).run(_critic_penalty)) < 1e-12


def _replica_penalty(group, rows):
    g = tplayers.resolve_group(group)
    torch.manual_seed(0)
    w0 = torch.randn(4, 3, dtype=F64)  # one replica held by every rank (holders=(p,))
    c = torch.randn(g.size, 4, 3, dtype=F64)  # what each rank multiplies it by

    def dense_loss(w):
        return sum((w * c[r]).sin().sum() for r in range(g.size))

    def tp_loss(w):  # each rank's share of the loss, summed over ranks
        return reduce_from_tp((sum_over_replicas(w, group=g, holders=(g.size,), rows=rows) * c[g.rank]).sin().sum(),
                              group=g)

    out = []
    for loss in (dense_loss, tp_loss):
        w = w0.clone().requires_grad_()
        (gw,) = torch.autograd.grad(loss(w), w, create_graph=True)
        lo, hi = rows or (0, 4)
        gw[lo:hi].pow(2).sum().backward()  # rows outside `rows` are this rank's own: not summed
        out.append(w.grad[lo:hi])
    return float((out[0] - out[1]).abs().max())


@pytest.mark.parametrize("tp", MULTI_RANK)
@pytest.mark.parametrize("rows", [None, (1, 3)])
def test_gradient_penalty_through_sum_over_replicas_matches_dense(tp, rows):
    assert max(get_world(tp).run(_replica_penalty, rows)) < 1e-10


def _loss_second_backward(group):
    g = tplayers.resolve_group(group)
    vocab = 8 * g.size + 3
    torch.manual_seed(0)
    logits = torch.randn(3, (vocab + g.size - 1) // g.size, dtype=F64, requires_grad=True)
    loss = tplayers.vocab_parallel_cross_entropy(logits, torch.tensor([0, 5, vocab - 1]), group=group,
                                                 vocab_size=vocab)
    (glogits,) = torch.autograd.grad(loss, logits, create_graph=True)  # first order alone is fine
    with pytest.raises(RuntimeError, match="vocab_parallel_cross_entropy does not support double backward"):
        (glogits.pow(2).sum() + logits.sum()).backward()  # used to run, without the softmax's term
    return True


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_double_backward_through_the_loss_raises_instead_of_a_wrong_number(tp):
    assert all(get_world(tp).run(_loss_second_backward))


def _gpt_penalty(group):
    torch.manual_seed(0)
    config = tplayers.GPTConfig(vocab_size=19, hidden=16, n_heads=4, n_kv_heads=2, ffn_hidden=32, n_layers=1)
    model = tplayers.ParallelGPT.from_dense(tplayers.models.dense.DenseGPT(config).double(), group=group)
    ids = torch.randint(0, 19, (1, 4))
    loss = model.loss(ids, ids)
    (gw,) = torch.autograd.grad(loss, model.blocks[0].mlp.fc2.weight, create_graph=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        gw.pow(2).sum().backward()
    return True


def test_double_backward_through_a_gpt_loss_raises():
    assert all(get_world(2).run(_gpt_penalty))


def _split_mlp_penalty(group, sp, activation):
    """The split-backward MLP (one Function over both layers) under create_graph=True."""
    from tplayers.models.dense import DenseMLP

    torch.manual_seed(1)
    dense = DenseMLP(8, 16, activation, True, dtype=F64)
    mlp = tplayers.ParallelMLP.from_dense(dense, group=group, sequence_parallel=sp, split_backward=True)
    tp = _MLP(mlp, nn.Identity(), group, sp)
    ref = _MLP(dense, nn.Identity())
    x = torch.randn(2, 4, 8, dtype=F64)
    gx_dense, gx_tp = _penalty(ref, x, "square"), _penalty(tp, x, "square")
    torch.testing.assert_close(gx_tp, gx_dense, rtol=1e-10, atol=1e-10)
    got = dense_parameters(mlp, grads=True)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    return True


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])  # (torch's CPU SDPA has no double backward, dense or TP)
def test_gradient_penalty_through_the_split_backward_mlp_matches_dense(activation, sp):
    assert all(get_world(2).run(_split_mlp_penalty, sp, activation))
