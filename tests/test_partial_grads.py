"""PartialGradSum: replicated parameters with partial gradients (norms under sequence parallelism) summed
by one all-reduce per forward, whatever order the modules are called in."""
import pytest
import torch
import torch.nn as nn

import tplayers
from tplayers.layers.base import route_params_through
from tplayers.regions.partial_grads import PartialGradSum
from tplayers.testing import get_world

H = 6


class _Norms(nn.Module):
    """``a`` read twice in one forward (a shared module), ``b`` once, ``frozen`` without a gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.frozen = nn.LayerNorm(H), nn.LayerNorm(H), nn.LayerNorm(H)
        self.frozen.requires_grad_(False)
        for p in self.parameters():
            nn.init.normal_(p, generator=torch.Generator().manual_seed(3))

    def forward(self, x):
        return self.b(self.a(x) + self.a(2 * x)).mul(self.frozen(x))


def _partial_grads(group):
    g = tplayers.resolve_group(group)
    dense = _Norms().double()
    model = _Norms().double()
    model.load_state_dict(dense.state_dict())
    sums = PartialGradSum(g)
    for m in (model.a, model.b, model.frozen):
        sums.register(m, ("weight", "bias"))
        route_params_through(m, ("weight", "bias"), sums.read)
    x = torch.randn(2, 4 * g.size, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = x.chunk(g.size, 1)[g.rank]  # this rank's tokens: every norm's gradient here is a partial sum
    counts = []
    with tplayers.comm_accounting() as acc:
        model(mine).sum().backward()  # a read twice: two sets, two all-reduces
    counts.append(len(acc.records))
    dense(x).sum().backward()
    for name, p in dense.named_parameters():
        got = dict(model.named_parameters())[name].grad
        if p.requires_grad:
            torch.testing.assert_close(got, p.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
        else:
            assert got is None
    # two forwards before one backward (each its own set), and torch.autograd.grad (no .grad)
    with tplayers.comm_accounting() as acc:
        loss = model(mine).sum() + model(2 * mine).sum()
        got = torch.autograd.grad(loss, [model.b.weight])[0]
    counts.append(len(acc.records))
    model.b.weight.grad = None
    expected = torch.autograd.grad(dense(x).sum() + dense(2 * x).sum(), [dense.b.weight])[0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # nothing recorded, nothing summed
        model(mine)
    # a set left partly unread (only ``a`` called), then an optimizer-like in-place step: ``b`` gets a new set
    model.a(mine)
    with torch.no_grad():
        for m in (model, dense):
            m.b.weight.mul_(1.5)
    got = torch.autograd.grad(model.b(mine).square().sum(), [model.b.weight])[0]
    expected = torch.autograd.grad(dense.b(x).square().sum(), [dense.b.weight])[0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    return counts, [r.op for r in acc.records]


@pytest.mark.parametrize("tp", [2, 3])
def test_partial_gradients_summed_once_per_set_in_any_call_order(tp):
    for counts, ops in get_world(tp).run(_partial_grads):
        assert counts == [2, 4] and set(ops) == {"all_reduce"}, (counts, ops)
