"""TP x PP x DP on 8 ranks (issue 57): a (pp, dp, tp) = 2 x 2 x 2 mesh, two pipeline stages cut by hand
(torchtitan style: each keeps the full model's names, its own layers only), each parallelized over its TP group and
audited, FSDP2 over dp (each block, then the stage), `PipelineStage` over pp, GPipe or 1F1B with 4 microbatches, AdamW; saved into one checkpoint with every
stage's optimizer, resumed at (pp 2, dp 1, tp 4), trained on: equal to the dense model trained on the global batch.
One persistent 8-rank world (tests/test_tp_invariant.py's eight-rank test shares it)."""

import pytest
import torch
import torch.nn as nn

import tplayers
from tplayers.testing import get_world

from test_state_views import HIDDEN, _Block as Block  # (a pre-norm MLP block, hidden 8)

LAYERS, BATCH, MICRO, STEPS, RESUMED = 4, 8, 4, 3, 2


class Model(nn.Module):
    """``blocks.{i}`` for the layers in ``keep`` (a stage), all of them by default (the dense model)."""

    def __init__(self, keep=range(LAYERS)) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(LAYERS) if i in keep})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return tuple(torch.randn(BATCH, 3, HIDDEN, generator=g, dtype=torch.float64) for _ in range(2))  # the global batch


def _dense_run(steps: int) -> dict:
    torch.manual_seed(0)
    dense = Model().double()
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = _data(step)
        loss_fn(dense(x), y).backward()  # (equal microbatches and replicas: the mean over the global batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in dense.named_parameters()}


def _stage(mesh, schedule: str):
    """This rank's stage of the dense model (seed 0), parallelized over its TP group and audited, FSDP2 over dp, its
    schedule."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pp = mesh.get_local_rank("pp")
    torch.manual_seed(0)
    dense = Model().double()
    keep = [i for i in range(LAYERS) if i * 2 // LAYERS == pp]
    stage_module = Model(keep).double()
    stage_module.load_state_dict({k: v for k, v in dense.state_dict().items() if int(k.split(".")[1]) in keep})
    plan = {"blocks.*.fc1": "column", "blocks.*.fc2": "row"}
    tplayers.parallelize(stage_module, plan, group=mesh["tp"])
    report = tplayers.audit(stage_module, torch.randn(1, 3, HIDDEN, dtype=torch.float64))  # (before fully_shard)
    assert report.passed, str(report)
    if mesh["dp"].size() > 1:
        for block in stage_module.blocks.values():
            fully_shard(block, mesh=mesh["dp"])  # each TP shard sharded again over dp
        fully_shard(stage_module, mesh=mesh["dp"])
    stage = PipelineStage(stage_module, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return stage_module, cls(stage, n_microbatches=MICRO, loss_fn=loss_fn)


def _train(mesh, stage_module, schedule, opt, steps) -> None:
    dp, pp = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    for step in steps:
        x, y = (t.chunk(mesh["dp"].size())[dp] for t in _data(step))  # dp replicas split the global batch
        schedule.step(x) if pp == 0 else schedule.step(target=y)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _flat():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # pipeline stages' optimizers: keyed by parameter name, not by group index (torch's option for MPMD, as
    # torchtitan saves; without it stage 0's group 0 and stage 1's collide in DCP and a load loses lr, betas ...)
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _save(stage_module, opt, path: str, route: str) -> None:
    """tplayers' checkpoint (every stage's optimizer with it), or torch's DCP route as torchtitan saves."""
    if route == "tplayers":
        tplayers.save_checkpoint(stage_module, path, optimizer=opt)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(stage_module, opt, options=_flat())
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def _load(stage_module, opt, path: str, route: str) -> None:
    if route == "tplayers":
        tplayers.load_checkpoint(stage_module, path, optimizer=opt)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(stage_module, opt, options=_flat())
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(stage_module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_flat())


def _three_d(group, schedule: str, path: str, route: str = "tplayers"):
    """3 steps at (pp 2, dp 2, tp 2), save (every stage's optimizer too), load at (pp 2, dp 1, tp 4), 2 steps: this
    rank's dense parameters against the dense model's after 5 steps."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    stage_module, step = _stage(mesh, schedule)
    opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-2)
    _train(mesh, stage_module, step, opt, range(STEPS))
    _save(stage_module, opt, path, route)
    mesh = init_device_mesh("cpu", (2, 1, 4), mesh_dim_names=("pp", "dp", "tp"))
    stage_module, step = _stage(mesh, schedule)  # (built from the seed-0 weights: the checkpoint replaces them)
    opt = torch.optim.AdamW(stage_module.parameters(), lr=0.5)  # (the saved lr comes back)
    _load(stage_module, opt, path, route)
    _train(mesh, stage_module, step, opt, range(STEPS, STEPS + RESUMED))
    want = _dense_run(STEPS + RESUMED)
    got = tplayers.testing.dense_parameters(stage_module)
    return max(float((t - want[n]).abs().max()) for n, t in got.items()), sorted(got)


@pytest.mark.parametrize("schedule, route", [("gpipe", "tplayers"), ("1f1b", "tplayers"), ("1f1b", "dcp")])
def test_tp_x_pp_x_dp_trains_saves_and_resumes_at_another_layout_like_dense(tmp_path, schedule, route):
    """Both routes: tplayers.save_checkpoint / load_checkpoint with every stage's optimizer (before: optimizer=
    with stages refused), and torch's get_state_dict / dcp.save / dcp.load / set_state_dict."""
    pytest.importorskip("torch.distributed.pipelining")
    results = get_world(8).run(_three_d, schedule, str(tmp_path / "ck"), route, timeout=300)
    for rank, (error, names) in enumerate(results):
        assert error < 1e-12, (rank, error)
        assert names == sorted(f"blocks.{i}.{n}" for i in ((0, 1) if rank < 4 else (2, 3))
                               for n in ("norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight",
                                         "fc2.bias")), (rank, names)
