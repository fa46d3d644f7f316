"""The audit leaves the model as it found it: buffers, tensor attributes and plain attributes (KV caches written
in place in forward, a position counter), whether the plan cuts the caches (``'k_cache:1'`` on registered
buffers) or not. Before: the audit's sharded run wrote into the real caches (its graph left in them: the user's
backward failed "backward through the graph a second time", as DeepSeek-V3's reference MLA does) and advanced the
counter; the twin restored only ``vars()`` attributes, so a cut buffer cache failed with a shape mismatch."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tplayers
from tplayers.testing import dense_parameters, get_world

H, HEADS, B, S, MAX = 16, 4, 2, 3, 12


class CachedAttention(nn.Module):
    """Caches registered as buffers (allocated at init, as a model set up for generation), written in place."""

    def __init__(self):
        super().__init__()
        self.n_heads, self.head_dim = HEADS, H // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.register_buffer("k_cache", torch.zeros(B, HEADS, MAX, H // HEADS), persistent=False)
        self.register_buffer("v_cache", torch.zeros(B, HEADS, MAX, H // HEADS), persistent=False)
        self.pos = 0  # where the next tokens go: advanced by each call that does not give start_pos

    def forward(self, x, start_pos=None):  # (b, s, h)
        b, s, _ = x.shape
        start = self.pos if start_pos is None else start_pos
        q, k, v = (w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        end = start + s
        self.k_cache[:b, :, start:end] = k  # (the graph kept in the cache, as DeepSeek-V3's reference does)
        self.v_cache[:b, :, start:end] = v
        if start_pos is None:
            self.pos = end
        keys, values = self.k_cache[:b, :, :end], self.v_cache[:b, :, :end]
        weights = F.softmax(q @ keys.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1)  # (b, n, s, end)
        return self.wo((weights @ values).transpose(1, 2).reshape(b, s, -1))


class LatentCache(CachedAttention):
    """The cache holds the layer's input (whole on every rank: as multi-head latent attention caches its latent),
    keys and values computed from it."""

    def __init__(self):
        super().__init__()
        del self.k_cache, self.v_cache
        self.register_buffer("latent", torch.zeros(B, MAX, H), persistent=False)

    def forward(self, x, start_pos=None):
        b, s, _ = x.shape
        start = self.pos if start_pos is None else start_pos
        end = start + s
        self.latent[:b, start:end] = x
        if start_pos is None:
            self.pos = end
        past = self.latent[:b, :end]  # (b, end, h), the graph kept in the cache
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (w(past).view(b, end, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wk, self.wv))
        weights = F.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1)
        return self.wo((weights @ v).transpose(1, 2).reshape(b, s, -1))


class Model(nn.Module):
    def __init__(self, latent=False):
        super().__init__()
        self.attn = LatentCache() if latent else CachedAttention()
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x, start_pos=None):
        x = x + self.attn(x, start_pos)
        return x + self.down(F.gelu(self.up(x)))


LAYERS = {"attn.wq": "column", "attn.wk": "column", "attn.wv": "column", "attn.wo": "row", "up": "column", "down": "row"}
PLANS = {False: tplayers.Plan(name="cached", layers=LAYERS, divide_attrs={"attn": ("n_heads", "k_cache:1", "v_cache:1")}),
         True: tplayers.Plan(name="latent", layers=LAYERS, divide_attrs={"attn": ("n_heads",)})}


def _one_step(group, start_pos, latent):
    torch.manual_seed(0)
    dense = Model(latent).double()
    model = tplayers.parallelize(copy.deepcopy(dense), PLANS[latent], group=group)
    x = torch.randn(B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out_t, out_d = model(x, start_pos), dense(x, start_pos)
    out_t.square().sum().backward()  # before: backward through the audit's freed graph (start_pos=0)
    out_d.square().sum().backward()
    assert tplayers.coverage(model).audit.passed, str(tplayers.coverage(model).audit)
    grads = dense_parameters(model, grads=True)
    worst = max(float((grads[n] - p.grad).abs().max()) for n, p in dense.named_parameters())
    rank, p = group.rank(), group.size()
    mine = slice(rank * HEADS // p, (rank + 1) * HEADS // p)
    caches = all(torch.allclose(getattr(model.attn, c), getattr(dense.attn, c)[:, slice(None) if latent else mine],
                                rtol=1e-12, atol=1e-14) for c in (("latent",) if latent else ("k_cache", "v_cache")))
    return float((out_t - out_d).abs().max()), worst, model.attn.pos, dense.attn.pos, caches


@pytest.mark.parametrize("start_pos, latent", [(0, False), (None, False), (0, True), (None, True)])
def test_the_audit_leaves_caches_and_counters_as_it_found_them(start_pos, latent):
    for out_err, grad_err, pos, dense_pos, caches in get_world(2).run(_one_step, start_pos, latent):
        assert out_err < 1e-12 and grad_err < 1e-12, (out_err, grad_err)
        assert pos == dense_pos and caches, (pos, dense_pos, caches)
