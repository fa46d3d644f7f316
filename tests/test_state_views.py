"""Shards the PyTorch ecosystem can see: a TP model's state_dict() and its optimizer's hold DTensors
over the TP group, so PyTorch's own checkpoint route (get_state_dict + torch.distributed.checkpoint)
writes each shard once and reshards model and AdamW moments at any TP size; layouts no DTensor
describes are refused naming the route; tplayers.save_checkpoint(optimizer=) handles every layout."""
import importlib.util

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tplayers
from tplayers.convert import Column
from tplayers.core.blocking import gather_placed
from tplayers.core.dtensors import UnlabelledShard
from tplayers.core.groups import resolve_group
from tplayers.layers import model_placements
from tplayers.testing import get_world
from torch.distributed.tensor import DTensor

VOCAB, HIDDEN = 31, 8  # 31 divides no TP size > 1: the vocabulary is padded


class Net(nn.Module):
    """Embedding -> norm -> MLP (gate/up fused or not) -> head: every layout tplayers gives a small LM."""

    def __init__(self, fused: bool, vocab: int = VOCAB) -> None:
        super().__init__()
        self.fused = fused
        self.emb = nn.Embedding(vocab, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        if fused:
            self.up = nn.Linear(HIDDEN, 8 * HIDDEN)  # [gate; up], each 4 * HIDDEN
        else:
            self.gate, self.up = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (b, s) -> (b, s, vocab)
        x = self.emb(ids)  # (b, s, h)
        h = self.norm(x)
        gate, up = self.up(h).chunk(2, dim=-1) if self.fused else (self.gate(h), self.up(h))  # (b, s, 4h/p) each
        return self.head(x + self.down(F.silu(gate) * up))


def _plan(fused: bool) -> dict:
    mlp = {"up": Column(parts=2)} if fused else {"gate": "column", "up": "column"}
    return {"emb": "vocab_embedding", **mlp, "down": "row"}  # the head stays replicated


def _build(group, seed: int, fused: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = Net(fused).double()
    tplayers.parallelize(model, _plan(fused), group=group, audit=False)
    return model


def _batch(step: int, dp: int = 1, dp_rank: int = 0):
    """Batch ``step`` of 4 sequences; under data parallelism, this replica's part of it."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (4, 5), generator=g)
    targets = torch.randint(0, VOCAB, (4, 5), generator=g)
    return ids.chunk(dp)[dp_rank], targets.chunk(dp)[dp_rank]


def _train(model, optimizer, steps, first: int = 0, dp: int = 1, dp_rank: int = 0) -> None:
    for step in range(first, first + steps):
        ids, targets = _batch(step, dp, dp_rank)
        F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()


def _dense_state(model, optimizer) -> dict:
    """Every parameter and every AdamW moment as the dense model's (gathered through placements)."""
    placements = model_placements(model)
    out = {}
    for name, p in model.named_parameters():
        placement = placements.get(name)

        def whole(t):
            t = t.full_tensor() if isinstance(t, DTensor) else t  # FSDP2's DTensor over dp: the TP shard
            if placement is None or not placement.is_sharded:
                return t.detach().clone()
            return gather_placed(t.detach(), placement, group=_group_of(model, name)).clone()  # TP 1: a view
        out[name] = whole(p)
        for key, value in optimizer.state[p].items():
            out[f"{name}:{key}"] = whole(value) if value.dim() else value.clone()
    return out


def _group_of(model, name):
    return model.get_submodule(name.rpartition(".")[0]).group


def _dcp_save(group, path: str, steps: int):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _build(group, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, steps)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _dense_state(model, optimizer)


def _dcp_load(group, path: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _build(group, seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _dense_state(model, optimizer)


@pytest.mark.parametrize("save_tp", [2])
def test_torch_dcp_route_reshards_model_and_adamw_moments(tmp_path, save_tp):
    """get_state_dict + dcp.save at TP 2, dcp.load + set_state_dict at TP 1, 2, 4: every parameter and
    moment bit-exact. Before: plain tensors under one name on several ranks, which DCP took for replicas
    (TP 2 -> 2: half the shards came back as the other rank's; TP 2 -> 4: torch's size mismatch)."""
    path = str(tmp_path / "dcp")
    saved = get_world(save_tp).run(_dcp_save, path, steps=2)[0]
    assert any(":exp_avg_sq" in k for k in saved)
    for tp in (1, 2, 4):
        for rank, loaded in enumerate(get_world(tp).run(_dcp_load, path)):
            assert set(loaded) == set(saved)
            for name, t in saved.items():
                assert torch.equal(loaded[name], t), f"TP {save_tp} -> {tp}, rank {rank}: {name} differs"


def _views(group):
    model = _build(group, seed=3)
    g = resolve_group(group)
    sd = model.state_dict()
    kinds = {k: (type(v).__name__, tuple(v.shape)) for k, v in sd.items()}
    back = _build(group, seed=4)
    back.load_state_dict(sd)  # the DTensors -> this rank's rows
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), back.parameters()))
    torch.manual_seed(3)
    dense = Net(False).double()
    whole = _build(group, seed=5)
    whole.load_state_dict(dense.state_dict())  # the dense tensors -> this rank's rows
    from_dense = all(torch.equal(a, b) for a, b in zip(model.parameters(), whole.parameters()))
    return g.size, kinds, same, from_dense


def test_state_dict_labels_shards_as_dtensors():
    for size, kinds, same, from_dense in get_world(2).run(_views):
        assert same and from_dense
        assert kinds["emb.weight"] == ("DTensor", (VOCAB, HIDDEN))  # the dense shape, not (16, 8)
        assert kinds["up.weight"] == ("DTensor", (4 * HIDDEN, HIDDEN))
        assert kinds["down.weight"] == ("DTensor", (HIDDEN, 4 * HIDDEN))
        assert kinds["down.bias"] == ("Tensor", (HIDDEN,))  # replicated: whole on every rank
        assert kinds["norm.weight"] == ("Tensor", (HIDDEN,))


def _fused_views(group):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _build(group, seed=3, fused=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 1)
    errors = []
    for call in (model.state_dict, lambda: get_optimizer_state_dict(model, optimizer), optimizer.state_dict):
        try:
            call()
            errors.append("")
        except UnlabelledShard as e:
            errors.append(str(e))
    return errors


def test_layouts_no_dtensor_describes_are_refused_naming_the_route():
    for errors in get_world(2).run(_fused_views):
        for e, name in zip(errors, ["'up.weight'", "'FusedColumnParallelLinear.weight'", "'FusedColumnParallelLinear.weight'"]):
            assert name in e and "fuses 2 components" in e, e
            assert "tplayers.save_checkpoint(model, path, optimizer=" in e, e


def _tplayers_save(group, path: str, steps: int, resumed: int):
    """Train ``steps`` AdamW steps, save model and optimizer, train ``resumed`` more without interruption."""
    model = _build(group, seed=1, fused=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    _train(model, optimizer, steps)
    tplayers.save_checkpoint(model, path, optimizer=optimizer)
    at_save = _dense_state(model, optimizer)
    _train(model, optimizer, resumed, first=steps)
    return at_save, _dense_state(model, optimizer)


def _tplayers_resume(group, path: str, steps: int, resumed: int):
    model = _build(group, seed=2, fused=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5.0)  # the checkpoint's hyperparameters replace these
    tplayers.load_checkpoint(model, path, optimizer=optimizer)
    loaded = _dense_state(model, optimizer)
    hyper = (optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["betas"])
    _train(model, optimizer, resumed, first=steps)
    return loaded, hyper, _dense_state(model, optimizer)


def test_save_checkpoint_with_optimizer_resumes_at_any_tp_size(tmp_path):
    """save_checkpoint(optimizer=) at TP 2 on fused gate/up and a padded vocabulary (layouts no DTensor
    describes): every moment loads bit-exactly at TP 1, 2 and 4; resumed for 50 steps at TP 2 the run is the
    uninterrupted one bit for bit, at TP 1 and 4 it is within float64 rounding."""
    path, steps, resumed = str(tmp_path / "ckpt"), 3, 50
    at_save, uninterrupted = get_world(2).run(_tplayers_save, path, steps, resumed)[0]
    assert sum(":exp_avg" in k for k in at_save) == 2 * sum(":" not in k for k in at_save)
    for tp in (1, 2, 4):
        for rank, (loaded, hyper, final) in enumerate(get_world(tp).run(_tplayers_resume, path, steps, resumed)):
            assert hyper == (1e-2, (0.8, 0.9))
            for name, t in at_save.items():
                assert torch.equal(loaded[name], t), f"TP 2 -> {tp}, rank {rank}: {name} differs"
            for name, t in uninterrupted.items():
                if tp == 2:
                    assert torch.equal(final[name], t), f"resumed at TP 2, rank {rank}: {name} differs"
                else:
                    torch.testing.assert_close(final[name], t, rtol=1e-10, atol=1e-12, msg=name)


def _wrong_optimizer(group, path: str):
    model = _build(group, seed=2, fused=True)
    errors = []
    for optimizer in (torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.optim.AdamW([p for n, p in model.named_parameters() if n != "norm.bias"], lr=0.1)):
        try:
            tplayers.load_checkpoint(model, path, optimizer=optimizer)
            errors.append("")
        except tplayers.io.CheckpointError as e:
            errors.append(str(e))
    return errors


def test_load_checkpoint_refuses_another_optimizers_state(tmp_path):
    path = str(tmp_path / "ckpt")
    get_world(2).run(_tplayers_save, path, 1, 0)
    sgd, fewer = get_world(2).run(_wrong_optimizer, path)[0]
    assert "holds AdamW's state; this optimizer is SGD" in sgd, sgd
    assert "parameter groups differ from the checkpoint's" in fewer, fewer
    model = _build(None, seed=2, fused=True)
    with pytest.raises(tplayers.io.CheckpointError, match="holds no optimizer state"):
        tplayers.save_checkpoint(model, str(tmp_path / "bare"))
        tplayers.load_checkpoint(model, str(tmp_path / "bare"), optimizer=torch.optim.AdamW(model.parameters()))


def _ddp_over_tp_peers(group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_build(group, seed=1))  # the default group: the world, i.e. both TP ranks
    ids, _ = _batch(0)
    try:
        model(ids)
    except RuntimeError as e:
        return str(e), model.module.up.weight.grad
    return "", None


def test_ddp_over_tp_peers_is_refused_before_a_step():
    """DDP over the TP ranks broadcasts rank 0's shards to rank 1 (before: the model trained on with them,
    no error). Refused on every rank at the first forward, naming the fix, before any gradient exists."""
    for error, grad in get_world(2).run(_ddp_over_tp_peers):
        assert "inside DistributedDataParallel over ranks [0, 1], which include TP peers [0, 1]" in error, error
        assert "process_group=mesh.dp_group" in error and "transformers.Trainer" in error
        assert grad is None


def _fsdp(group, seed: int, dp: int, tp: int, fused: bool = True, vocab: int = VOCAB):
    """Net (by default fused gate/up, padded vocabulary) on a (dp, tp) mesh: TP over "tp", FSDP2 over "dp"."""
    from torch.distributed.fsdp import fully_shard

    mesh = tplayers.make_2d_mesh(dp=dp, tp=tp)
    torch.manual_seed(seed)
    model = tplayers.parallelize(Net(fused, vocab).double(), _plan(fused), group=mesh.mesh, audit=False)
    if dp > 1:
        for layer in (model.emb, model.up, model.down) + (() if fused else (model.gate,)):
            fully_shard(layer, mesh=mesh.dp_mesh)  # each TP shard sharded again over dp
        fully_shard(model, mesh=mesh.dp_mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), dict(dp=dp, dp_rank=mesh.dp_rank)


def _fsdp_save(group, path: str, dense_path: str):
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    model, optimizer, split = _fsdp(group, 1, dp=2, tp=2)
    _train(model, optimizer, 2, **split)
    tplayers.save_checkpoint(model, path, optimizer=optimizer)
    has_safetensors = importlib.util.find_spec("safetensors") is not None
    if has_safetensors:
        tplayers.save_dense(model, dense_path)
    at_save = _dense_state(model, optimizer)
    _train(model, optimizer, 2, first=2, **split)
    return at_save, _dense_state(model, optimizer), has_safetensors


def _fsdp_resume(group, path: str, dp: int, tp: int, dense_path: str = ""):
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    from_dense = None
    if dense_path:  # the dense export loads back into a TP x FSDP2 model, slice by slice
        model, optimizer, split = _fsdp(group, 3, dp=dp, tp=tp)
        tplayers.load_dense(model, dense_path)
        from_dense = _dense_state(model, optimizer)
    model, optimizer, split = _fsdp(group, 2, dp=dp, tp=tp)
    tplayers.load_checkpoint(model, path, optimizer=optimizer)
    loaded = _dense_state(model, optimizer)
    _train(model, optimizer, 2, first=2, **split)
    refused = ""
    try:
        model.state_dict()  # FSDP2 over TP: no 1-D DTensor says what a rank holds; refused, naming the route
    except UnlabelledShard as e:
        refused = str(e)
    return loaded, _dense_state(model, optimizer), refused, from_dense


def test_tp_x_fsdp2_checkpoint_resumes_across_dp_and_tp_sizes(tmp_path):
    """save_checkpoint(optimizer=) of a dp 2 x tp 2 FSDP2 model (before: refused, and the DCP route it
    pointed to gave TP ranks each other's shards): model and AdamW moments load bit-exactly at dp 2 x tp 2,
    dp 1 x tp 4 and dp 4 x tp 1; resumed at dp 2 x tp 2, the run is the uninterrupted one bit for bit;
    save_dense writes the dense model."""
    path, dense_path = str(tmp_path / "ckpt"), str(tmp_path / "dense" / "model.safetensors")
    at_save, uninterrupted, has_safetensors = get_world(4).run(_fsdp_save, path, dense_path)[0]
    for dp, tp in ((2, 2), (1, 4), (4, 1)):
        dense = dense_path if has_safetensors and (dp, tp) == (2, 2) else ""
        for rank, (loaded, final, refused, from_dense) in enumerate(get_world(4).run(_fsdp_resume, path, dp, tp,
                                                                                      dense)):
            if dense:
                assert all(torch.equal(from_dense[k], at_save[k]) for k in from_dense if ":" not in k)
            for name, t in at_save.items():
                assert torch.equal(loaded[name], t), f"dp 2 x tp 2 -> dp {dp} x tp {tp}, rank {rank}: {name} differs"
            for name, t in uninterrupted.items():
                if (dp, tp) == (2, 2):
                    assert torch.equal(final[name], t), f"resumed at dp 2 x tp 2, rank {rank}: {name} differs"
                else:
                    torch.testing.assert_close(final[name], t, rtol=1e-10, atol=1e-12, msg=name)
            if dp > 1 and tp > 1:
                assert "this TP shard is sharded again by FSDP2 and its TP shard has padding rows" in refused, refused
                assert "tplayers.save_checkpoint" in refused, refused
    if has_safetensors:
        from safetensors.torch import load_file

        on_disk = load_file(dense_path)
        assert set(on_disk) == {k for k in at_save if ":" not in k}
        assert all(torch.equal(on_disk[k], at_save[k]) for k in on_disk)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h)
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _pipeline_stages(group, schedule: str):
    """Two blocks as two pipeline stages (pp 2) of two TP ranks each, built by hand with PipelineStage, the
    default audit on; one GPipe or 1F1B step against the dense model's gradients (2 microbatches)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from tplayers.convert.audit import AUDIT_ATTR

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    torch.manual_seed(0)
    dense = nn.Sequential(_Block(), _Block()).double()
    stage_module = tplayers.parallelize(copy.deepcopy(dense[pp]), {"fc1": "column", "fc2": "row"}, group=mesh["tp"])
    stage = PipelineStage(stage_module, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))

    def loss_fn(out, target):
        return (out - target).square().mean()

    step = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, n_microbatches=2, loss_fn=loss_fn)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(4, 3, HIDDEN, generator=g, dtype=torch.float64) for _ in range(2))
    for _ in range(8):  # leave rank-specific bytes where torch.empty will find them (freed memory is reused)
        torch.full((2, 3, HIDDEN), float(dist.get_rank()) + 0.5, dtype=torch.float64).sum()
    step.step(x) if pp == 0 else step.step(target=y)  # stage 1's shape inference runs on torch.empty activations
    (sum(loss_fn(dense(xm), ym) for xm, ym in zip(x.chunk(2), y.chunk(2))) / 2).backward()  # mean over microbatches
    want = dict(dense[pp].named_parameters())
    error = 0.0
    for name, p in stage_module.named_parameters():
        d = want[name].grad
        d = d.chunk(2, 0)[tp] if name.startswith("fc1.") else d.chunk(2, 1)[tp] if name == "fc2.weight" else d
        error = max(error, (p.grad - d).abs().max().item())
    audited = [r.status for r in getattr(stage_module, AUDIT_ATTR).results.values()]
    return error, audited


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_of_tp_ranks_train_like_dense_with_the_default_audit(schedule):
    """Before: PipelineStage's shape inference (a forward and backward on uninitialized activations,
    different on each rank) tripped the inputs check inside the audit, which blamed the plan."""
    for error, audited in get_world(4).run(_pipeline_stages, schedule):
        assert error < 1e-12 and audited == ["passed"], (error, audited)


def _exported(group):
    from torch.distributed.pipelining import SplitPoint, pipeline

    model = _build(group, seed=1)
    ids, _ = _batch(0)
    errors = []
    for trace in (lambda: torch.export.export(model, (ids,)),
                  lambda: pipeline(model, mb_args=(ids,), split_spec={"down": SplitPoint.BEGINNING})):
        try:
            trace()
            errors.append("")
        except Exception as e:  # noqa: BLE001 (pipeline() re-raises it: the user's traceback shows the chain)
            chain = []
            while e is not None:
                chain.append(str(e))
                e = e.__cause__ or e.__context__
            errors.append(" <- ".join(chain))
    return errors


def test_torch_export_and_pipeline_refuse_tp_collectives():
    """Before: pipeline() traced the forward collectives and lost the backward ones (gradients 0.27 off,
    the LM head exactly 2x dense, no error)."""
    for errors in get_world(2).run(_exported):
        for e in errors:
            assert "a tensor-parallel collective is being traced by torch.export" in e, e
            assert "PipelineStage" in e


def _trainer_over_tp_ranks(group, out_dir: str):
    """transformers.Trainer as users run it on the TP ranks (its own DDP over the world)."""
    import os

    import torch.distributed as dist

    launcher = dict(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # what torchrun sets; the group already exists
    saved = {k: os.environ.get(k) for k in launcher}
    os.environ.update(launcher)
    try:
        return _trainer_step(group, out_dir)
    finally:  # this rank process serves other tests: torchrun's variables would change what they do
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _trainer_step(group, out_dir: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2)
    model = tplayers.parallelize(LlamaForCausalLM(config), "auto", group=group)
    data = [{"input_ids": torch.arange(8) + i, "labels": torch.arange(8) + i} for i in range(4)]
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True,
                             save_strategy="no", logging_strategy="no", ddp_backend="gloo", disable_tqdm=True)
    try:
        Trainer(model=model, args=args, train_dataset=data).train()
    except RuntimeError as e:
        return str(e)
    return ""


def test_transformers_trainer_on_tp_ranks_is_refused_naming_ddp():
    """Before: Trainer's DDP over the world copied rank 0's shards to rank 1; the first forward then stopped on
    the inputs check with a hint that named only Lightning."""
    pytest.importorskip("transformers")
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        for error in get_world(2).run(_trainer_over_tp_ranks, out_dir):
            assert "inside DistributedDataParallel over ranks [0, 1]" in error and "transformers.Trainer" in error, error


def _fsdp_dcp_save(group, path: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer, split = _fsdp(group, 1, dp=2, tp=2, fused=False, vocab=32)
    _train(model, optimizer, 2, **split)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    kinds = {k: [type(p).__name__ for p in v.placements] for k, v in model_sd.items() if isinstance(v, DTensor)}
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _dense_state(model, optimizer), kinds


def _fsdp_dcp_load(group, path: str, dp: int, tp: int):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer, _ = _fsdp(group, 2, dp=dp, tp=tp, fused=False, vocab=32)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _dense_state(model, optimizer)


def test_torch_dcp_route_on_tp_x_fsdp2_labels_shards_over_the_2d_mesh(tmp_path):
    """get_state_dict + dcp.save of a dp 2 x tp 2 FSDP2 model: TP shards labelled over the (dp, tp) mesh, as torch's
    own TP x FSDP2 does (_StridedShard for dim-0 TP shards); dcp.load + set_state_dict at dp 2 x tp 2, dp 1 x tp 4
    and dp 4 x tp 1: model and AdamW moments bit-exact. Before: FSDP2's DTensor over dp presented each TP shard as
    the whole tensor, and DCP gave TP ranks each other's shards and moments."""
    path = str(tmp_path / "dcp")
    saved, kinds = get_world(4).run(_fsdp_dcp_save, path)[0]
    assert kinds["up.weight"] == ["_StridedShard", "Shard"] and kinds["down.weight"] == ["Shard", "Shard"], kinds
    assert kinds["head.weight"] == ["Shard"]  # replicated over TP: FSDP2's own DTensor over dp
    for dp, tp in ((2, 2), (1, 4), (4, 1)):
        for rank, loaded in enumerate(get_world(4).run(_fsdp_dcp_load, path, dp, tp)):
            assert set(loaded) == set(saved)
            for name, t in saved.items():
                assert torch.equal(loaded[name], t), f"dp 2 x tp 2 -> dp {dp} x tp {tp}, rank {rank}: {name} differs"


def _save_pretrained(group, root: str):
    """Hugging Face's and PEFT's save_pretrained on TP models: refused alone (before: this rank's shards written as
    the whole tensors, no error); with the dense state dict gathered on every rank, the dense adapter / model."""
    import copy
    import os

    import torch.distributed as dist
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4)
    base = LlamaForCausalLM(config)
    dense = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["q_proj", "o_proj"],
                                                           init_lora_weights=False))
    errors, same = [], []
    for model, dense_model, load in ((copy.deepcopy(dense), dense, lambda d: PeftModel.from_pretrained(
            copy.deepcopy(base), d)), (copy.deepcopy(base), base, LlamaForCausalLM.from_pretrained)):
        tplayers.parallelize(model, "auto", group=group)
        path = os.path.join(root, type(model).__name__)
        try:
            model.save_pretrained(path)
            errors.append("")
        except RuntimeError as e:
            errors.append(str(e))
        model.save_pretrained(path, state_dict=tplayers.io.dense_state_dict(model), is_main_process=dist.get_rank() == 0)
        dist.barrier()
        back, want = load(path).state_dict(), dense_model.state_dict()
        same.append(set(back) == set(want) and all(torch.equal(back[k], want[k]) for k in want))
    return errors, same


def test_save_pretrained_of_a_tp_model_refuses_alone_and_saves_dense_with_the_route(tmp_path):
    pytest.importorskip("peft")
    for errors, same in get_world(2).run(_save_pretrained, str(tmp_path)):
        assert same == [True, True]
        for e in errors:
            assert "save_pretrained on a tensor-parallel model" in e and "tplayers.io.dense_state_dict(model)" in e, e


def _fsdp_dcp_save_on_a_3d_mesh(group, path: str):
    """The model of a (pp, dp, tp) mesh's stage (pp 1 here: 4 ranks), TP over "tp", FSDP2 over "dp"; saved through
    torch's DCP route."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(1)
    model = tplayers.parallelize(Net(False, 32).double(), _plan(False), group=mesh["tp"], audit=False)
    for layer in (model.emb, model.up, model.down, model.gate):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 2, dp=2, dp_rank=mesh["dp"].get_local_rank())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    meshes = {k: v.device_mesh.mesh_dim_names for k, v in model_sd.items() if isinstance(v, DTensor)}
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _dense_state(model, optimizer), meshes


def test_torch_dcp_route_on_a_3d_mesh_labels_shards_over_its_dp_tp_sub_mesh(tmp_path):
    """Issue 57. Before: UnlabelledShard ("the mesh must be 2-D") on a (pp, dp, tp) mesh, which torchtitan saves
    through DCP; now labelled over the stage's (dp, tp) sub-mesh, and loaded back at dp 2 x tp 2 and dp 1 x tp 4."""
    path = str(tmp_path / "dcp3d")
    saved, meshes = get_world(4).run(_fsdp_dcp_save_on_a_3d_mesh, path)[0]
    assert meshes["up.weight"] == ("dp", "tp"), meshes
    for dp, tp in ((2, 2), (1, 4)):
        for rank, loaded in enumerate(get_world(4).run(_fsdp_dcp_load, path, dp, tp)):
            for name, t in saved.items():
                assert torch.equal(loaded[name], t), f"3-D save -> dp {dp} x tp {tp}, rank {rank}: {name} differs"
