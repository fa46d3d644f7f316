"""2-D parallelism on 4 ranks (dp 2 x tp 2): TP + DDP and TP + FSDP2 train like dense on the
global batch."""
import copy

import pytest
import torch
import torch.nn as nn

import tplayers
from tplayers.io.state_dict import model_layouts, shard_state_dict
from tplayers.testing import get_world

STEPS, GLOBAL_BATCH, SEQ, HIDDEN = 3, 4, 3, 8


class MLPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 5)

    def forward(self, x):  # (b, s, h)
        return self.head(x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


PLAN = {"fc1": "column", "fc2": "row"}


class AttnNet(nn.Module):
    """GQA with one KV head at tp 2: the KV rows are a piece replicated on both TP ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = tplayers.models.dense.DenseAttention(HIDDEN, n_heads=2, n_kv_heads=1)
        self.head = nn.Linear(HIDDEN, 5)

    def forward(self, x):  # (b, s, h)
        return self.head(x + self.attn(x))


class MoENet(nn.Module):
    """tplayers' own MoE block (4 experts, top 2) in a residual: whole experts per TP rank, tokens sent to them by
    all-to-all (expert parallelism over the TP group), the experts replicated over dp like every TP shard."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = tplayers.models.moe.DenseMoE(HIDDEN, 2 * HIDDEN, 4, 2, dtype=torch.float64)
        self.head = nn.Linear(HIDDEN, 5)

    def forward(self, x):  # (b, s, h)
        return self.head(x + self.moe(x))


def _train(model, batches, clip=None, lr=1e-2):
    """Train; ``clip(model) -> norm`` runs between backward and step. Returns the norms."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    norms = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if clip is not None:
            norms.append(float(clip(model)))
        opt.step()
    return norms


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, SEQ, HIDDEN, generator=g, dtype=torch.float64),
             torch.randint(0, 5, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(STEPS)]


def _check_2d(group, wrap: str, seed: int, norm_type=None, net="mlp", idle_rank=False):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = tplayers.make_2d_mesh(dp=2, tp=2)
    torch.manual_seed(seed)
    if net == "mlp":
        dense = MLPNet().double()
        model = tplayers.parallelize(copy.deepcopy(dense), PLAN, group=mesh.mesh)  # the mesh's "tp" dim
    elif net == "moe":
        dense = MoENet().double()
        if idle_rank:  # every token routed to the same two experts in the first step: one TP rank's experts get none
            with torch.no_grad():
                dense.moe.router.weight.zero_()
        model = copy.deepcopy(dense)
        model.moe = tplayers.ParallelMoE.from_dense(dense.moe, group=mesh.mesh, experts="all_to_all")
    else:
        dense = AttnNet().double()
        model = copy.deepcopy(dense)
        model.attn = tplayers.ParallelAttention.from_dense(dense.attn, group=mesh.mesh)
    data = _data(seed)
    dp_rank, dp = mesh.dp_rank, mesh.dp_size
    local = [(x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]) for x, y in data]  # this replica's half of the batch
    if wrap == "ddp":
        trained = DDP(model, process_group=mesh.dp_group)
    else:
        for m in {"mlp": ("fc1", "fc2"), "gqa": ("attn",), "moe": ("moe",)}[net]:
            fully_shard(getattr(model, m), mesh=mesh.dp_mesh)
        trained = fully_shard(model, mesh=mesh.dp_mesh)
        if net == "mlp":
            local_rows = model.fc1.weight.to_local().shape[0]  # FSDP2 shards the TP shard again, over dp
            assert local_rows == 4 * HIDDEN // 2 // 2, local_rows
    tp_clip = dense_clip = None
    if norm_type is not None:  # a max_norm well below the gradients' norm: every step clips
        tp_clip = lambda m: tplayers.clip_grad_norm_(model, 0.05, norm_type, group=mesh.mesh)  # noqa: E731
        dense_clip = lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, norm_type)  # noqa: E731
    tp_norms = _train(trained, local, tp_clip)
    dense_norms = _train(dense, data, dense_clip)
    torch.testing.assert_close(tp_norms, dense_norms, rtol=1e-9, atol=0)
    assert norm_type is None or min(dense_norms) > 0.05

    # compare this rank's TP shards with the dense result cut the same way
    want = shard_state_dict(dense.state_dict(), model_layouts(model), mesh.tp.rank, mesh.tp.size)
    errors = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: gather over dp
        torch.testing.assert_close(t.detach(), want[name], rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
        errors[name] = float((t.detach() - want[name]).abs().max())
    return max(errors.values())


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_tp_with_data_parallel_matches_dense_training(wrap):
    errs = get_world(4).run(_check_2d, wrap, seed=0)
    assert max(errs) < 1e-9


@pytest.mark.parametrize("wrap, idle_rank", [("ddp", False), ("ddp", True), ("fsdp2", True)])
def test_expert_parallel_moe_on_a_tp_x_dp_mesh_trains_like_dense(wrap, idle_rank):
    """EP x TP on one (dp, tp) mesh: whole experts per TP rank with tokens sent by all-to-all, every dp replica
    holding the same experts (DDP averages their gradients, FSDP2 shards them over dp), gradients clipped by the
    dense norm, AdamW (weight decay): the weights follow dense training on the global batch. Also when a TP
    rank's experts get no token in a step: their gradients are zeros, as the dense experts' (DDP raised 'did not
    receive grad' on the next step before, and AdamW would have skipped them)."""
    errs = get_world(4).run(_check_2d, wrap, seed=2, norm_type=2.0, net="moe", idle_rank=idle_rank)
    assert max(errs) < 1e-9


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
@pytest.mark.parametrize("norm_type, net", [(2.0, "mlp"), (float("inf"), "mlp"), (2.0, "gqa"), (3.0, "gqa")])
def test_clip_grad_norm_on_a_tp_x_dp_mesh_equals_dense_clipping(wrap, norm_type, net):
    # the norm at every step and the clipped training both equal torch's clip on the dense model;
    # "gqa": one KV head at tp 2, a replicated piece that must be counted once (FSDP2: gathered first)
    errs = get_world(4).run(_check_2d, wrap, seed=1, norm_type=norm_type, net=net)
    assert max(errs) < 1e-9


def _bad_mesh(group):
    with pytest.raises(ValueError, match="dp=3 x tp=2"):
        tplayers.make_2d_mesh(dp=3, tp=2)
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        tplayers.make_2d_mesh(tp=3)
    return True


def test_make_2d_mesh_rejects_wrong_sizes():
    assert all(get_world(4).run(_bad_mesh))


def _ddp_checkpoint(group, path):
    mesh = tplayers.make_2d_mesh(dp=2, tp=2)
    torch.manual_seed(1)
    dense = MLPNet().double()
    ddp_model = tplayers.parallelize(copy.deepcopy(dense), PLAN, group=mesh.mesh)
    tplayers.save_checkpoint(torch.nn.parallel.DistributedDataParallel(ddp_model, process_group=mesh.dp_group).module,
                             path)  # DDP replicas of one shard are written once
    tp4 = tplayers.parallelize(MLPNet().double(), PLAN, group=group)  # all 4 ranks as one TP group
    tplayers.load_checkpoint(tp4, path)
    loaded = tplayers.io.dense_state_dict(tp4)
    return all(torch.equal(loaded[k], v) for k, v in dense.state_dict().items())


def test_checkpoint_of_dp2_tp2_ddp_model_loads_at_tp4(tmp_path):
    """(TP x FSDP2 checkpoints: tests/test_state_views.py.)"""
    assert all(get_world(4).run(_ddp_checkpoint, str(tmp_path / "ckpt")))
    assert (tmp_path / "ckpt" / "tplayers.json").is_file()


def test_default_mesh_device_follows_the_backend():
    """init_process_group() without a backend reports 'undefined'; on a GPU machine the mesh must
    still be a CUDA mesh (a CPU mesh makes FSDP2 move the model to the CPU)."""
    from tplayers.convert.mesh2d import _default_device_type

    assert _default_device_type("undefined", cuda_available=True) == "cuda"
    assert _default_device_type("cpu:gloo,cuda:nccl", cuda_available=True) == "cuda"
    assert _default_device_type("nccl", cuda_available=True) == "cuda"
    assert _default_device_type("gloo", cuda_available=True) == "cpu"
    assert _default_device_type("undefined", cuda_available=False) == "cpu"



def _fsdp2_example(group, path):
    """examples/fsdp2_tp.py's ``train`` on this rank (loaded from its file: examples/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fsdp2_tp_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.train(group)


def test_fsdp2_example_trains_like_dense():
    """examples/fsdp2_tp.py (TP x FSDP2 on a 2x2 mesh, audit, clip_grad_norm_, AdamW) equals dense
    training on the global batch, on every rank. Run here on the suite's 4-rank world (its launcher,
    ``python examples/fsdp2_tp.py``, starts the same ranks with tplayers.testing.World)."""
    from conftest import ROOT

    results = get_world(4).run(_fsdp2_example, str(ROOT / "examples" / "fsdp2_tp.py"))
    for result in results:
        assert result["steps"] == 3 and len(result["grad_norms"]) == 3
        assert result["clipped_steps"] == 3  # max_norm below every step's norm: the clip is exercised
        assert result["max_norm_error"] < 1e-9 and result["max_weight_error"] < 1e-9, result
    assert len({tuple(r["grad_norms"]) for r in results}) == 1  # one norm, on every rank


class QKVBlock(nn.Module):
    """q, k, v on one normed input (an attention's shape): under TP they share one backward all-reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v = (nn.Linear(HIDDEN, 2 * HIDDEN) for _ in range(3))
        self.o = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):  # (b, s, h)
        h = self.norm(x)
        return x + self.o(self.q(h) * self.k(h) + self.v(h))


class QKVNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = QKVBlock(), nn.Linear(HIDDEN, 5)

    def forward(self, x):
        return self.head(self.block(x))


def _siblings_under_data_parallel(group, wrap: str, precision: str):
    """One step of QKVNet on a dp 2 x tp 2 mesh wrapped in DDP or FSDP2 (per block, as torchtitan wraps), in float32,
    under bf16 autocast, or (FSDP2) with MixedPrecisionPolicy(bfloat16): the TP collectives of the backward, and
    the gradients against the dense model's on the global batch."""
    import contextlib

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = tplayers.make_2d_mesh(dp=2, tp=2)
    torch.manual_seed(0)
    dense = QKVNet()
    model = tplayers.parallelize(copy.deepcopy(dense), {"block.q": "column", "block.k": "column", "block.v": "column",
                                                        "block.o": "row"}, group=mesh.mesh)
    x, y = _data(0)[0]
    x = x.float()
    tplayers.audit(model, x.chunk(2)[mesh.dp_rank])  # (its own collectives, before the wrapping and the counted step)
    mixed = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()
    if wrap == "ddp":
        trained = DDP(model, process_group=mesh.dp_group)
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "mp_policy" else MixedPrecisionPolicy()
        if wrap == "fsdp2_per_linear":  # each linear its own unit: its pre-forward hook casts x for it alone
            for name in "qkvo":
                fully_shard(getattr(model.block, name), mesh=mesh.dp_mesh, mp_policy=policy)
        fully_shard(model.block, mesh=mesh.dp_mesh, mp_policy=policy)
        trained = fully_shard(model, mesh=mesh.dp_mesh, mp_policy=policy)
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    post_backward, order = FSDPParamGroup.post_backward, []  # (FSDP2 unit, TP collectives of the backward so far)

    def watched(self, *args):
        order.append((self._module_fqn, sum(1 for r in acc.records if r.phase == "backward")))
        return post_backward(self, *args)
    FSDPParamGroup.post_backward = watched
    try:
        with tplayers.comm_accounting() as acc, mixed:
            loss = nn.functional.cross_entropy(trained(x.chunk(2)[mesh.dp_rank]).float().flatten(0, 1),
                                               y.chunk(2)[mesh.dp_rank].flatten())
            loss.backward()
    finally:
        FSDPParamGroup.post_backward = post_backward
    with (torch.autocast("cpu", dtype=torch.bfloat16) if precision != "float32" else contextlib.nullcontext()):
        nn.functional.cross_entropy(dense(x).float().flatten(0, 1), y.flatten()).backward()
    want = shard_state_dict({n: p.grad for n, p in dense.named_parameters()}, model_layouts(model), mesh.tp.rank,
                            mesh.tp.size)
    tol = 1e-5 if precision == "float32" else 5e-2
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(g.float(), want[name], rtol=tol, atol=tol * float(want[name].abs().max()),
                                   msg=lambda m: f"{name}: {m}")
    return [(r.op, r.nbytes) for r in acc.records if r.phase == "backward"], order


@pytest.mark.parametrize("wrap, precision", [("ddp", "float32"), ("ddp", "autocast"), ("fsdp2", "float32"),
                                             ("fsdp2", "mp_policy"), ("fsdp2_per_linear", "mp_policy")])
def test_siblings_share_one_all_reduce_under_ddp_and_fsdp2(wrap, precision):
    """q/k/v's input gradient: one TP all-reduce of (b/dp, s, h) per step, in the dtype the columns compute in.
    FSDP2 wrapping each linear on its own (a cast of x per layer, each through its own post-backward hook) too:
    before, the layers read three tensors and reduced three times."""
    elements = GLOBAL_BATCH // 2 * SEQ * HIDDEN
    size = 4 if precision == "float32" else 2
    for backward, order in get_world(4).run(_siblings_under_data_parallel, wrap, precision):
        assert backward == [("all_reduce", elements * size)], backward
        if wrap == "fsdp2_per_linear":  # each member's unit reduce-scatters right after its backward: v and k before
            # the set's all-reduce, q (the first called, whose weight the entry takes) after it
            assert [(name.split(".")[-1], n) for name, n in order if name.startswith("block.")][:4] == \
                [("o", 0), ("v", 0), ("k", 0), ("q", 1)], order
