"""check_replicas and clip_grad_norm_ when ranks disagree about gradients: every rank raises (or gets
the same norm) instead of one rank crashing or hanging in a collective the others never enter."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tplayers
from tplayers.testing import get_world

from _helpers import MULTI_RANK


def _model(group):
    torch.manual_seed(0)
    return nn.Sequential(tplayers.ColumnParallelLinear(4, 8, group=group), nn.LayerNorm(8))


def _grad_on_one_rank(group):
    model = _model(group)
    if tplayers.resolve_group(group).rank == 0:  # e.g. a rank whose batch skipped this branch
        model[1].weight.grad = torch.ones(8)
    with pytest.raises(AssertionError, match=r"check_replicas: '1.weight' gradient is missing \(None\) on rank\(s\) "):
        tplayers.check_replicas(model)  # used to abort the process: the ranks gathered different sizes
    return True


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_check_replicas_names_a_gradient_missing_on_some_ranks(tp):
    assert all(get_world(tp).run(_grad_on_one_rank))


def _different_models(group):
    model = _model(group)
    if tplayers.resolve_group(group).rank == 1:  # one rank built an extra replicated layer
        model.append(nn.Linear(8, 8))
    with pytest.raises(AssertionError, match=r"check_replicas: rank\(s\) \[1\] of the TP group list different "
                                             r"parameters than rank 0"):
        tplayers.check_replicas(model)  # without the listing check: an all-gather of (n, 3) tensors of different n
    return True


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_check_replicas_refuses_ranks_with_different_parameter_lists(tp):
    assert all(get_world(tp).run(_different_models))


def _norm_gradient_not_reduced(group):
    g = tplayers.resolve_group(group)
    torch.manual_seed(0)
    norm = tplayers.ParallelNorm(8, "rmsnorm", group=group, sequence_parallel=True)
    x = torch.randn(2, 3, 8) + g.rank  # this rank's sequence shard
    F.rms_norm(x, (8,), norm.weight, norm.eps).sum().backward()  # the norm's own forward bypassed: no all-reduce
    with pytest.raises(AssertionError, match=r"'weight' gradient differs between rank 0 and rank\(s\) .*partial sum"):
        tplayers.check_replicas(norm)
    norm.weight.grad = None
    norm(x).sum().backward()  # through ParallelNorm: reduced, equal everywhere
    return tplayers.check_replicas(norm)


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_check_replicas_catches_a_sequence_parallel_norm_gradient_that_was_not_reduced(tp):
    assert get_world(tp).run(_norm_gradient_not_reduced) == [2] * tp  # weight value and gradient


def _clip_with_grads_on_one_rank(group):
    model = _model(group)
    if tplayers.resolve_group(group).rank == 0:
        model[1].weight.grad = torch.ones(8)
    return float(tplayers.clip_grad_norm_(model, 1.0))  # used to hang: only rank 0 entered the all-reduce


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_clip_grad_norm_with_gradients_on_some_ranks_gives_every_rank_one_norm(tp):
    norms = get_world(tp).run(_clip_with_grads_on_one_rank)
    assert len(set(norms)) == 1 and norms[0] > 0, norms


@pytest.mark.parametrize("fn", [tplayers.clip_grad_norm_, lambda params, _: tplayers.check_replicas(params)])
def test_bare_parameters_are_refused(fn):
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"pass the model \(an nn.Module\), not generator"):
        fn(model.parameters(), 1.0)


# ------------------------------------------------------------------ bad arguments


def _mesh_without_this_rank(group):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh("cpu", [0, 1])
    if dist.get_rank() < 2:
        with torch.random.fork_rng():  # only these ranks draw: keep the world's RNG states in step for later tests
            return tplayers.ColumnParallelLinear(4, 8, group=mesh).group.size
    with pytest.raises(ValueError, match=rf"global rank {dist.get_rank()}\) is not part of the DeviceMesh it was "
                                         r"given \(ranks \[0, 1\]\)"):
        tplayers.ColumnParallelLinear(4, 8, group=mesh)  # used to be an IndexError from inside torch
    return None


def test_a_device_mesh_without_this_rank_is_refused():
    assert get_world(4).run(_mesh_without_this_rank) == [2, 2, None, None]


def test_a_zero_size_norm_is_refused():
    with pytest.raises(ValueError, match="ParallelNorm: hidden=0 must be positive"):
        tplayers.ParallelNorm(0, "rmsnorm", group=None)


def _inputs_audit(group):
    g = tplayers.resolve_group(group)
    torch.manual_seed(0)
    model = nn.Sequential(tplayers.ColumnParallelLinear(4, 8, group=group, gather_output=True))
    handle = tplayers.check_same_inputs(model, group=group)
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    model(x)  # the same batch everywhere: fine
    with pytest.raises(ValueError, match=r"check_same_inputs: Sequential forward #2: argument 0 differs between rank 0 "
                                         r"and rank 1 of the TP group: every TP rank must see the same batch"):
        model(x + (g.rank == 1))  # e.g. a distributed sampler over the TP ranks
    with pytest.raises(ValueError, match="argument 0 differs"):  # a different batch size, too
        model(x[: 2 + (g.rank == 1)])
    handle.remove()
    model(x + (g.rank == 1))  # removed: no check
    every = tplayers.check_same_inputs(model, group=group, every=2)
    model(x)
    model(x + g.rank)  # forward #2: not checked
    with pytest.raises(ValueError, match="forward #3"):
        model(x + g.rank)
    every.remove()
    return True


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_check_same_inputs_names_a_batch_that_differs_across_tp_ranks(tp):
    assert all(get_world(tp).run(_inputs_audit))


def _clip_with_a_foreign_group(group):
    """A 2 x 2 mesh: the model is TP over its tp dim; clipping (or checking replicas) over the whole
    world instead would sum the norm over data-parallel replicas too (a wrong norm, before): refused
    on every rank, naming both groups. The model's own group, or one with the same ranks, is fine."""
    import torch.distributed as dist
    mesh = tplayers.make_2d_mesh(dp=2, tp=2)
    torch.manual_seed(0)
    model = nn.Sequential(tplayers.ColumnParallelLinear(4, 8, group=mesh.tp_group),
                          tplayers.RowParallelLinear(8, 4, group=mesh.tp_group))
    model(torch.randn(3, 4)).sum().backward()
    refused = []
    for fn in (lambda g: tplayers.clip_grad_norm_(model, 1.0, group=g), lambda g: tplayers.check_replicas(model, group=g)):
        with pytest.raises(ValueError, match=r"not the TP group of the model's layers \(ranks \[\d, \d\]\): it has "
                                             r"ranks \[0, 1, 2, 3\]") as e:
            fn(dist.group.WORLD)
        refused.append(str(e.value))
        fn(mesh.tp_group)
        fn(None)
    return refused


def test_a_group_other_than_the_models_tp_group_is_refused():
    for refused in get_world(4).run(_clip_with_a_foreign_group):
        assert len(refused) == 2 and "clip_grad_norm_" in refused[0] and "check_replicas" in refused[1]


def _overflow_on_one_rank(group, scaler_kind):
    """float16-style loss scaling with an overflow in rank 1's shard only."""
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    tplayers.parallelize(model, {"0": "column", "2": "row"}, group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu") if scaler_kind == "torch" else ShardedGradScaler("cpu", process_group=group)
    scaler.scale(model(torch.randn(4, 8)).square().sum()).backward()
    if dist.get_rank() == 1:
        model[0].weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    bias = model[2].bias.detach().clone()
    try:  # the next step
        model(torch.randn(4, 8)).sum().backward()
    except tplayers.RanksDiverged as e:
        return bias, scaler.get_scale(), str(e)
    return bias, scaler.get_scale(), "no error"


@pytest.mark.parametrize("scaler_kind", ["torch", "sharded"])
def test_a_loss_scaler_that_combines_overflows_keeps_tp_ranks_together(scaler_kind):
    """docs/gpu.md's route: torch's GradScaler decides per rank (one rank steps, the other skips: replicas
    diverge, and the next forward raises on every rank naming the parameter and the route; before: it trained
    on); ShardedGradScaler over the TP group skips on every rank."""
    (bias0, scale0, next0), (bias1, scale1, next1) = get_world(2).run(_overflow_on_one_rank, scaler_kind)
    if scaler_kind == "torch":
        assert scale0 != scale1 and not torch.equal(bias0, bias1)
        for message in (next0, next1):
            assert "the replicated parameters of Sequential: '2.bias' differs" in message, message
            assert "ShardedGradScaler" in message, message
    else:
        assert scale0 == scale1 and torch.equal(bias0, bias1) and next0 == next1 == "no error"
