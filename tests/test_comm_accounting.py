"""Comm accounting counts every collective a block issues (the textbook figures) and the emulated
link makes each complete no earlier than its alpha-beta time, results unchanged."""
import copy
import os
import time

import pytest
import torch

import tplayers
from tplayers.core.collectives import all_reduce
from tplayers.core.blocking import all_reduce_tensor
from tplayers.models.dense import DenseTransformerBlock
from tplayers.testing import get_world

from _helpers import Timeline

B, S, H = 2, 8, 16  # b * s * h = 256 elements per activation


def _block_records(group, sp):
    g = tplayers.resolve_group(group)
    torch.manual_seed(0)
    dense = DenseTransformerBlock(tplayers.BlockConfig(hidden=H, n_heads=4, ffn_hidden=2 * H)).double()
    block = tplayers.ParallelTransformerBlock.from_dense(dense, group=group, sequence_parallel=sp)
    x = torch.randn(B, S, H, dtype=torch.float64)
    x = (g.shard(x, 1) if sp else x).requires_grad_(True)
    with tplayers.comm_accounting(block) as acct:
        block(x).sum().backward()
    block(x)  # outside the context: not recorded
    return [(r.op, r.phase, r.nbytes, r.module, r.group_size) for r in acct.records], acct.summary()


@pytest.mark.parametrize("tp", [2, 4])
def test_block_without_sequence_parallelism_two_all_reduces_forward_and_two_backward(tp):
    records, summary = get_world(tp).run(_block_records, False)[0]
    act = B * S * H * 8  # float64 bytes of one (b, s, h) activation
    assert [(op, phase, n) for op, phase, n, _, _ in records] == [
        ("all_reduce", "forward", act), ("all_reduce", "forward", act),     # attention out-proj, fc2 (row)
        ("all_reduce", "backward", act), ("all_reduce", "backward", act)]   # fc1, qkv input gradients (column)
    assert [m for _, _, _, m, _ in records[:2]] == ["attn.proj", "mlp.fc2"]
    assert {p for *_, p in records} == {tp}
    assert summary["counts"] == {"all_reduce/backward": 2, "all_reduce/forward": 2}


@pytest.mark.parametrize("tp", [2, 4])
def test_block_with_sequence_parallelism_same_volume_in_gathers_and_scatters(tp):
    records, _ = get_world(tp).run(_block_records, True)[0]
    act = B * S * H * 8
    fwd = [(op, n, m) for op, phase, n, m, _ in records if phase == "forward"]
    # (the MLP runs fc1 and fc2 as one region keeping its tokens rank-major between them: its collectives are the
    # MLP's own)
    assert fwd == [("all_gather", act, "attn.qkv"), ("reduce_scatter", act, "attn.proj"),
                   ("all_gather", act, "mlp"), ("reduce_scatter", act, "mlp")]
    bwd = [(op, n) for op, phase, n, _, _ in records if phase == "backward"]
    big = sorted(op for op, n in bwd if n == act)
    # per row layer: all-gather of the output gradient; per column layer: its input re-gathered for the
    # weight gradient and the input gradient reduce-scattered
    assert big == ["all_gather"] * 4 + ["reduce_scatter"] * 2
    # the norms' replicated weights and biases see only s/p tokens: their gradients are all-reduced (h each)
    assert sorted((op, n) for op, n in bwd if n != act) == [("all_reduce", H * 8)] * 4
    # the same wire volume as without SP: a ring all-reduce = a reduce-scatter + an all-gather
    assert sum(n for op, n, _ in fwd) == 2 * (2 * act)


def test_link_model_formulas():
    link = tplayers.LinkModel(bandwidth_gbps=2.0, latency_us=10.0)
    n, p = 4_000_000, 4  # 4 MB over 4 ranks at 2 GB/s
    assert link.seconds("all_reduce", n, p) == pytest.approx(2 * 3 / 4 * n / 2e9 + 2 * 3 * 10e-6)
    assert link.seconds("all_gather", n, p) == pytest.approx(3 / 4 * n / 2e9 + 3 * 10e-6)
    assert link.seconds("reduce_scatter", n, p) == link.seconds("all_gather", n, p)
    assert link.seconds("broadcast", n, p) == pytest.approx(n / 2e9 + 10e-6)
    assert link.seconds("all_reduce", n, 1) == 0.0
    with pytest.raises(ValueError, match="no model for collective 'alltoall'"):
        link.seconds("alltoall", n, p)


def test_parse_link_specs():
    assert tplayers.parse_link("h100-nvlink") == tplayers.bench.link.PRESETS["h100-nvlink"]
    assert tplayers.parse_link("0.05/20") == tplayers.LinkModel(0.05, 20.0, "0.05/20")
    assert tplayers.parse_link("3").latency_us == 0.0
    matched = tplayers.parse_link("match:h100-nvlink", tflops=0.989)  # a machine 1000x slower than an H100
    assert matched.bandwidth_gbps == pytest.approx(0.45) and matched.spec == "match:h100-nvlink"
    for bad, message in [("fast", "expected a preset"), ("1/2/3", "expected a preset"), ("-1", "bandwidth must be"),
                         ("1/-5", "latency must be"), ("match:warp", "match: needs a preset")]:
        with pytest.raises(ValueError, match=message):
            tplayers.parse_link(bad)


def _emulated(group):
    g = tplayers.resolve_group(group)
    x = torch.arange(10_000, dtype=torch.float64) * (g.rank + 1)  # 80 kB
    plain = all_reduce_tensor(x, group=group)
    link = tplayers.LinkModel(0.01, 1000.0)  # 10 MB/s, 1 ms per step
    modeled = link.seconds("all_reduce", x.numel() * 8, g.size)
    with tplayers.emulated_link(link), tplayers.comm_accounting() as acct:
        t0 = time.perf_counter()
        emulated = all_reduce_tensor(x, group=group)
        one = time.perf_counter() - t0
        # two async collectives on one link run one after the other
        t0 = time.perf_counter()
        first, second = all_reduce(x.clone(), g, async_op=True), all_reduce(x.clone(), g, async_op=True)
        first.wait(), second.wait()
        two = time.perf_counter() - t0
    after = all_reduce_tensor(x, group=group)
    return torch.equal(plain, emulated) and torch.equal(plain, after), one, two, modeled, len(acct.records)


@pytest.mark.parametrize("tp", [2, 4])
def test_emulated_collectives_take_their_modeled_time_and_stay_exact(tp):
    for same, one, two, modeled, n in get_world(tp).run(_emulated):
        assert same and n == 3
        assert one >= modeled and two >= 2 * modeled  # lower bounds: sleeps, never flaky


def _everywhere(group):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    g = tplayers.resolve_group(group)
    originals = (dist.all_reduce, funcol.all_reduce)
    link = tplayers.LinkModel(0.01, 1000.0)
    x = torch.arange(10_000, dtype=torch.float64) * (g.rank + 1)  # 80 kB
    modeled = link.seconds("all_reduce", x.numel() * 8, g.size)
    mesh = init_device_mesh("cpu", (g.size,))
    with tplayers.emulated_link(link, everywhere=True):
        t0 = time.perf_counter()
        work = dist.all_reduce(y := x.clone(), async_op=True)  # megatron-core / fairscale style
        work.wait()
        plain_time = time.perf_counter() - t0
        t0 = time.perf_counter()
        z = funcol.all_reduce(x, "sum", mesh)  # DTensor's functional collectives
        z = z.wait() if hasattr(z, "wait") else z
        functional_time = time.perf_counter() - t0
        mine = all_reduce_tensor(x, group=group)  # tplayers' own: delayed once, not twice
    expected = x / (g.rank + 1) * sum(range(1, g.size + 1))
    restored = (dist.all_reduce, funcol.all_reduce) == originals
    return (torch.equal(y, expected) and torch.equal(z, expected) and torch.equal(mine, expected), restored,
            plain_time >= modeled, functional_time >= modeled)


@pytest.mark.parametrize("tp", [2])
def test_emulated_link_everywhere_slows_other_libraries_collectives_too(tp):
    assert get_world(tp).run(_everywhere) == [(True, True, True, True)] * tp


@pytest.fixture
def fake_world_of_two_on_cuda():
    """One process standing for rank 0 of 2 (torch's fake backend: collectives move nothing)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1",
                    reason="one hardware queue: the waiting stream's event is queued behind the link's (see accounting)")
def test_cuda_link_runs_on_the_gpu_timeline_without_blocking_the_host(fake_world_of_two_on_cuda):
    g = tplayers.resolve_group(fake_world_of_two_on_cuda)
    buf = torch.ones(2**18, device="cuda")  # 1 MiB: an all-reduce of 2 ranks moves n bytes per rank
    link = tplayers.LinkModel(buf.numel() * 4 / 0.05 / 1e9, 0.0)  # modeled: 50 ms
    a = torch.randn(2048, 2048, device="cuda")
    a @ a
    with tplayers.emulated_link(link):  # warm-up: the link stream, the sleep kernel's clock rate
        all_reduce(buf, g).wait()
    torch.cuda.synchronize()
    with tplayers.emulated_link(link), tplayers.comm_accounting() as acct:
        t0 = time.perf_counter()
        all_reduce(buf, g).wait()  # blocking: the stream stalls 50 ms, the host does not
        host_s = time.perf_counter() - t0
        pending = all_reduce(buf, g, async_op=True)
        for _ in range(20):  # GPU work under the second collective
            a = (a @ a).tanh_()
        pending.wait()
    blocking, overlapped = acct.records
    assert host_s < 0.02, f"the host waited {host_s:.3f} s"
    assert 0.045 < blocking.blocked_s < 0.07 and 0.045 < blocking.completed - blocking.launched < 0.07
    assert overlapped.blocked_s < blocking.blocked_s - 0.005, "compute under the collective hid none of it"


def test_core_is_observed_only_while_accounting_or_a_link_is_active():
    """Core's one observer hook is installed while anything of the bench floor watches (nested or
    not) and removed after, also when the body raises: outside, a collective costs one truth test."""
    from tplayers.core import collectives

    assert collectives._OBSERVER[0] is None
    with tplayers.comm_accounting():
        observer = collectives._OBSERVER[0]
        assert observer is not None
        with tplayers.emulated_link("h100-nvlink"):
            assert collectives._OBSERVER[0] is observer  # one observer, several watchers
        assert collectives._OBSERVER[0] is observer
    assert collectives._OBSERVER[0] is None
    with pytest.raises(RuntimeError, match="boom"):
        with tplayers.emulated_link("h100-nvlink"):
            raise RuntimeError("boom")
    assert collectives._OBSERVER[0] is None


class _Attention(torch.nn.Module):
    """q, k, v read the same x (as Hugging Face attentions do); x also feeds a residual."""

    def __init__(self, q, k, v, o):
        super().__init__()
        self.q, self.k, self.v, self.o = q, k, v, o

    def forward(self, x):
        return self.o(self.q(x) * self.k(x) + self.v(x)) + x


def _siblings(group, sizes):
    from tplayers.testing import dense_parameters

    torch.manual_seed(0)
    h, f = sizes
    dense = _Attention(*[torch.nn.Linear(h, f).double() for _ in range(3)], torch.nn.Linear(f, h).double())
    col = lambda m: tplayers.ColumnParallelLinear.from_dense(m, group=group)  # noqa: E731
    model = _Attention(col(dense.q), col(dense.k), col(dense.v), tplayers.RowParallelLinear.from_dense(dense.o, group=group))
    with tplayers.comm_accounting() as undeclared:  # undeclared: plain Megatron layers, each reduces its own
        model(torch.randn(2, 5, h, dtype=torch.float64, requires_grad=True)).sum().backward()
    model.zero_grad()
    tplayers.declare_siblings(model.q, model.k, model.v)
    x = torch.randn(2, 5, h, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    xd = x.detach().clone().requires_grad_()
    with tplayers.comm_accounting() as acc:
        model(x).square().sum().backward()
    dense(xd).square().sum().backward()
    torch.testing.assert_close(x.grad, xd.grad, rtol=1e-10, atol=1e-10)
    grads = dense_parameters(model, grads=True)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    # torch.autograd.grad (no .grad accumulation): the weight gradients come back from each layer itself
    wq = model.q.weight
    (gq,) = torch.autograd.grad(model(x).square().sum(), [wq])
    torch.testing.assert_close(gq, grads["q.weight"].chunk(group.size(), 0)[group.rank()], rtol=1e-10, atol=1e-10)
    # a member whose output this backward does not reach (k): the others' sum still completes
    x.grad = xd.grad = None
    q, _, v = model.q(x), model.k(x), model.v(x)
    torch.autograd.backward((q * v).sum())
    qd, vd = dense.q(xd), dense.v(xd)
    (qd * vd).sum().backward()  # each rank's (q * v).sum() is its features' share: the partials sum to this
    torch.testing.assert_close(x.grad, xd.grad, rtol=1e-10, atol=1e-10)
    backward = [r for r in acc.records if r.phase == "backward"]
    return [(r.op, r.nbytes) for r in backward], len([r for r in undeclared.records if r.phase == "backward"])


@pytest.mark.parametrize("tp", [2, 4])
def test_columns_on_the_same_input_share_one_backward_all_reduce(tp):
    for backward, undeclared in get_world(tp).run(_siblings, (8, 4 * tp)):
        assert backward == [("all_reduce", 2 * 5 * 8 * 8)], backward  # one f for q, k and v (was three)
        assert undeclared == 3  # layers no set declares: one each


class _GatheredAttention(torch.nn.Module):
    """An attention-like module that needs the whole sequence: it gathers its input itself; q and k read the
    gathered tensor (k through a view of all of it), a replicated branch reads it too."""

    def __init__(self, q, k, v, o, group):
        super().__init__()
        self.q, self.k, self.v, self.o, self.group = q, k, v, o, group
        self.inputs = tplayers.declare_siblings(q, k, v).inputs if group else None  # where the gather offers its shard

    def forward(self, x):  # (b, s/p, h)
        full = (tplayers.core.comm.gather_sequence_for_columns(x, group=self.group, inputs=self.inputs) if self.group
                else x)  # (b, s, h)
        s = full.shape[1] // (self.group.size() if self.group else 1)
        rank = self.group.rank() if self.group else 0
        replicated = torch.tanh(full)[:, rank * s:(rank + 1) * s]  # this rank's chunk of a replicated branch
        return self.o(self.q(full) * self.k(full[:, :]) + self.v(full)) + replicated + x


def _gathered_siblings(group):
    from tplayers.testing import dense_parameters

    torch.manual_seed(0)
    p, h, f = group.size(), 8, 4 * group.size()
    dense = _GatheredAttention(*[torch.nn.Linear(h, f).double() for _ in range(3)], torch.nn.Linear(f, h).double(),
                               None)
    col = lambda m: tplayers.ColumnParallelLinear.from_dense(m, group=group)  # noqa: E731
    row = tplayers.RowParallelLinear.from_dense(dense.o, group=group, sequence_parallel=True)
    model = _GatheredAttention(col(dense.q), col(dense.k), col(dense.v), row, group)
    xd = torch.randn(2, 3 * p, h, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x = xd.detach().chunk(p, 1)[group.rank()].clone().requires_grad_()
    weights = torch.randn(2, 3 * p, h, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with tplayers.comm_accounting() as acc:
        out = model(x)
        (out * weights.chunk(p, 1)[group.rank()]).sum().backward()
    out_d = dense(xd)
    (out_d * weights).sum().backward()
    torch.testing.assert_close(out, out_d.detach().chunk(p, 1)[group.rank()], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, xd.grad.chunk(p, 1)[group.rank()], rtol=1e-10, atol=1e-10)
    grads = dense_parameters(model, grads=True)
    for name, param in dense.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    return [(r.phase, r.op) for r in acc.records]


@pytest.mark.parametrize("tp", [2, 4])
def test_columns_on_a_sequence_their_module_gathered_reduce_scatter_into_its_shard(tp):
    # Megatron's layout although the module gathered its input itself (HF attention): q/k/v keep the shard, gather
    # it again in backward and reduce-scatter their summed input gradient; the replicated branch's gradient is split.
    for records in get_world(tp).run(_gathered_siblings):
        assert records == [("forward", "all_gather"), ("forward", "reduce_scatter"), ("backward", "all_gather"),
                           ("backward", "all_gather"), ("backward", "reduce_scatter")], records


PRECISIONS = ["float32", "autocast", "bfloat16"]  # float32 weights; the same under bf16 autocast; bf16 weights


def _precision(precision):
    import contextlib

    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    if precision == "autocast":
        return dtype, lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return dtype, contextlib.nullcontext


def _siblings_in(group, precision, gathered):
    """q/k/v on one input (gathered: the module gathers its sequence itself, HF attention under SP), in each
    precision: the collectives of a step, and the input gradient against the dense model's in that precision."""
    from tplayers.testing import dense_parameters

    torch.manual_seed(0)
    dtype, ctx = _precision(precision)
    p, h, f = group.size(), 8, 4 * group.size()
    build = (lambda *m: _GatheredAttention(*m, None)) if gathered else _Attention
    dense = build(*[torch.nn.Linear(h, f) for _ in range(3)], torch.nn.Linear(f, h)).to(dtype)
    col = lambda m: tplayers.ColumnParallelLinear.from_dense(m, group=group)  # noqa: E731
    row = tplayers.RowParallelLinear.from_dense(dense.o, group=group, sequence_parallel=gathered)
    model = (_GatheredAttention(col(dense.q), col(dense.k), col(dense.v), row, group) if gathered
             else _Attention(col(dense.q), col(dense.k), col(dense.v), row))
    if not gathered:
        tplayers.declare_siblings(model.q, model.k, model.v)
    xd = torch.randn(2, 2 * p, h, dtype=dtype, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x = (xd.detach().chunk(p, 1)[group.rank()] if gathered else xd.detach()).clone().requires_grad_()
    with tplayers.comm_accounting() as acc, ctx():
        model(x).float().square().sum().backward()
    with ctx():
        dense(xd).float().square().sum().backward()
    want = xd.grad.chunk(p, 1)[group.rank()] if gathered else xd.grad
    tol = 1e-5 if precision == "float32" else 5e-2
    torch.testing.assert_close(x.grad, want, rtol=tol, atol=tol * float(want.abs().max()))
    grads = dense_parameters(model, grads=True)
    for name, param in dense.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=tol, atol=tol * float(param.grad.abs().max()))
    return [(r.phase, r.op, r.nbytes) for r in acc.records]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("gathered", [False, True])
def test_siblings_share_their_collectives_in_every_precision(precision, gathered):
    """One all-reduce (SP: one gather each way, one reduce-scatter) for q, k and v under bf16 autocast as in
    float32. Before: under autocast each layer cast its own copy of x, the set broke on identity, and each
    layer reduced (and gathered) alone (3 backward all-reduces; SP: 3 gathers each way, 3 reduce-scatters)."""
    tp = 2
    act = 2 * 2 * tp * 8 * (4 if precision == "float32" else 2)  # (b, s, h) in the dtype the columns compute in
    if gathered:
        want = [("forward", "all_gather", 2 * 2 * tp * 8 * (2 if precision == "bfloat16" else 4)),
                ("forward", "reduce_scatter", act), ("backward", "all_gather", act // 4 * 4),
                ("backward", "all_gather", act), ("backward", "reduce_scatter", act)]
    else:
        want = [("forward", "all_reduce", act), ("backward", "all_reduce", act)]
    for records in get_world(tp).run(_siblings_in, precision, gathered):
        assert records == want, records


def _member_gemms_under_the_collective(group, precision):
    from tplayers.core import collectives

    torch.manual_seed(0)
    dtype, ctx = _precision(precision)
    h, f = 8, 4 * group.size()
    dense = _Attention(*[torch.nn.Linear(h, f) for _ in range(3)], torch.nn.Linear(f, h)).to(dtype)
    col = lambda m: tplayers.ColumnParallelLinear.from_dense(m, group=group)  # noqa: E731
    model = _Attention(col(dense.q), col(dense.k), col(dense.v), tplayers.RowParallelLinear.from_dense(dense.o, group=group))
    tplayers.declare_siblings(model.q, model.k, model.v)
    x = torch.randn(2, 6, h, dtype=dtype, generator=torch.Generator().manual_seed(1), requires_grad=True)
    timeline = Timeline({tuple(model.q.weight.shape): "wgrad"})
    with ctx():
        loss = model(x).float().square().sum()
    previous = collectives.set_observer(timeline)
    try:
        with timeline.mode:
            loss.backward()
    finally:
        collectives.set_observer(previous)
    return timeline.events


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_members_weight_gradient_runs_under_the_sets_one_collective(precision):
    """Issue 40: q, k and v's weight-gradient GEMMs all run while the set's one all-reduce is in flight (the call's
    entry runs them), as Megatron's fused q/k/v GEMM does. Before: only the last member's (["wgrad", "wgrad",
    "launch all_reduce", "wgrad", "wait all_reduce"])."""
    for events in get_world(2).run(_member_gemms_under_the_collective, precision):
        assert events == ["launch all_reduce", "wgrad", "wgrad", "wgrad", "wait all_reduce"], events


class _CrossAttention(torch.nn.Module):
    """q reads x; k and v read y (a cross-attention reads the encoder's states): one region, two inputs."""

    def __init__(self, h, f):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(h, f), torch.nn.Linear(h, f), torch.nn.Linear(h, f),
                                          torch.nn.Linear(f, h))

    def forward(self, x, y):
        return self.o(self.q(x) * self.k(y) + self.v(y)) + x


def _cross_attention(group):
    torch.manual_seed(0)
    dense = _CrossAttention(8, 4 * group.size()).double()
    model = tplayers.parallelize(copy.deepcopy(dense), {"q": "column", "k": "column", "v": "column", "o": "row"},
                                 group=group)
    assert model.q.siblings is model.k.siblings is model.v.siblings  # one region: one declared set
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randn(2, 3, 8, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2))
    xd, yd = (t.detach().clone().requires_grad_() for t in (x, y))
    model(x, y)  # (the audit's first forward)
    with tplayers.comm_accounting() as acc:
        model(x, y).square().sum().backward()
    dense(xd, yd).square().sum().backward()
    for got, want in ((x.grad, xd.grad), (y.grad, yd.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    return [r.op for r in acc.records if r.phase == "backward"]


def test_a_declared_set_shares_per_input():
    """The set is declared by region; the members called on y (k, v) share one all-reduce, q on x its own:
    the declaration never sums gradients of different tensors."""
    for ops in get_world(2).run(_cross_attention):
        assert ops == ["all_reduce", "all_reduce"], ops


def test_declare_siblings_refuses_what_is_not_a_set_of_column_layers():
    row = tplayers.RowParallelLinear(4, 4, group=None)
    col = tplayers.ColumnParallelLinear(4, 4, group=None)
    with pytest.raises(TypeError, match="RowParallelLinear is not a column-parallel layer"):
        tplayers.declare_siblings(col, row)
    with pytest.raises(ValueError, match="no layers given"):
        tplayers.declare_siblings()
    assert col.siblings is None  # (nothing declared by a refused call)
    assert tplayers.declare_siblings(col).inputs is col.siblings.inputs
