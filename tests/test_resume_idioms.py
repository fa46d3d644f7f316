"""PyTorch's own resume and averaging idioms on a TP model whose state is labelled (DTensors), written as
users write them, with plain PyTorch calls only: a per-rank ``torch.save`` of the optimizer's and the
model's ``state_dict()`` loaded into a fresh (or a stepped) optimizer at the same TP size,
``copy.deepcopy(model.state_dict())``, an EMA kept as ``{k: v.clone()}`` and updated in place, and
``torch.optim.swa_utils.AveragedModel``. Each resumes (or averages) to the same bits as the
uninterrupted run; a DTensor value that cannot be taken is refused at ``load_state_dict`` naming the
parameter and the route that works."""
import copy
import io

import pytest
import torch
import torch.nn as nn

import tplayers
from tplayers.testing import get_world

HIDDEN, FFN = 8, 32


def _model(group, seed: int) -> nn.Module:
    """Column -> GELU -> Row (the issue's model), float64, the same dense weights on every rank."""
    torch.manual_seed(seed)
    dense = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)).double()
    return tplayers.parallelize(dense, {"0": "column", "2": "row"}, group=group, audit=False)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 3, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(50 + step))


def _train(model, optimizer, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        model(_batch(step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2),
}


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loaded(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _bits(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def _per_rank_resume(group, kind: str, stepped: bool):
    """The uninterrupted run (6 steps) vs 3 steps, ``torch.save`` of both state dicts, a fresh model and a
    fresh optimizer (or one already stepped: ``stepped``) loading them back, 3 more steps."""
    make = OPTIMIZERS[kind]
    model = _model(group, seed=1)
    optimizer = make(model.parameters())
    _train(model, optimizer, 0, 6)
    straight = _bits(model)

    model = _model(group, seed=1)
    optimizer = make(model.parameters())
    _train(model, optimizer, 0, 3)
    model_file, optim_file = _saved(model.state_dict()), _saved(optimizer.state_dict())

    model = _model(group, seed=2)  # the new run starts from other weights: the load must replace them
    optimizer = make(model.parameters())
    if stepped:
        _train(model, optimizer, 10, 1)
    model.load_state_dict(_loaded(model_file))
    optimizer.load_state_dict(_loaded(optim_file))
    _train(model, optimizer, 3, 3)
    resumed = _bits(model)
    again = optimizer.state_dict()  # the resumed optimizer's state is labelled again
    labelled = sorted(type(v).__name__ for entry in again["state"].values() for v in entry.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
    return [torch.equal(a, b) for a, b in zip(straight, resumed)], labelled


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_per_rank_torch_save_resume_gives_the_uninterrupted_bits(kind, stepped):
    """Before: a fresh optimizer held the saved DTensor moments beside plain parameters and its first step
    raised torch's "aten.lerp_.Scalar got mixed torch.Tensor and DTensor"."""
    for rank, (same, labelled) in enumerate(get_world(2).run(_per_rank_resume, kind, stepped)):
        assert all(same), f"rank {rank}: parameters differ from the uninterrupted run: {same}"
        assert "DTensor" in labelled, f"rank {rank}: the resumed optimizer's state_dict() is not labelled"


@torch.no_grad()
def _ema_update(ema: dict, model: nn.Module) -> None:
    """Both spellings users write: ``mul_().add_()`` and ``lerp_``."""
    for k, v in model.state_dict().items():
        ema[k].mul_(0.9).add_(v, alpha=0.1)
    for k, v in model.state_dict().items():
        ema[k].lerp_(v, 0.25)


def _idioms(model: nn.Module, whole) -> tuple:
    """``copy.deepcopy(model.state_dict())`` restored later, and an EMA kept as ``{k: v.clone()}`` of
    ``state_dict()`` and updated in place each step (the way timm / many loops write it), loaded into the model;
    ``whole(model)``: the model's state as dense tensors, copied."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 0, 2)
    snapshot = copy.deepcopy(model.state_dict())
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for step in range(2, 5):
        _train(model, optimizer, step, 1)
        _ema_update(ema, model)
    after = whole(model)
    model.load_state_dict(snapshot)
    restored = whole(model)
    model.load_state_dict(ema)
    return after, restored, whole(model)


def _deepcopy_and_ema(group):
    return _idioms(_model(group, seed=3), _dense_copy)


def _dense_copy(model) -> dict:
    """The dense model's state, copied (``dense_state_dict`` gives replicated tensors as views, like ``state_dict()``)."""
    return {k: v.clone() for k, v in tplayers.io.dense_state_dict(model).items()}


def _dense_deepcopy_and_ema():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)).double()
    return _idioms(model, lambda m: {k: v.clone() for k, v in m.state_dict().items()})


def test_deepcopy_of_state_dict_and_an_in_place_ema_equal_the_dense_idioms():
    want = _dense_deepcopy_and_ema()
    for rank, got in enumerate(get_world(2).run(_deepcopy_and_ema)):
        for what, g, w in zip(("after training", "deepcopy restored", "EMA loaded"), got, want):
            assert set(g) == set(w)
            for k in w:
                torch.testing.assert_close(g[k], w[k], rtol=1e-12, atol=1e-12,
                                           msg=lambda m, k=k, what=what: f"rank {rank}, {what}, {k}: {m}")


def _averaging(model: nn.Module) -> tuple:
    """``AveragedModel`` (SWA's mean and an EMA ``multi_avg_fn``) kept over 3 steps of ``model``: the averaged
    models (their forward, their ``state_dict()``)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    swa, ema = AveragedModel(model), AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    for step in range(3):
        _train(model, optimizer, step, 1)
        swa.update_parameters(model)
        ema.update_parameters(model)
    x = _batch(99)
    return [swa(x).detach(), ema(x).detach()], (swa, ema)


def _averaged_model(group):
    """The averages of a TP model: their outputs, and their ``state_dict()`` loaded back into a TP model, dense."""
    outputs, averaged = _averaging(_model(group, seed=4))
    averages = []
    for avg in averaged:
        target = _model(group, seed=5)
        target.load_state_dict({k.removeprefix("module."): v for k, v in avg.state_dict().items()
                                if k.startswith("module.")})
        averages.append(_dense_copy(target))
    return outputs, averages


def test_averaged_model_of_a_tp_model_equals_the_dense_average():
    torch.manual_seed(4)
    want_out, averaged = _averaging(nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)).double())
    want_avg = [avg.module.state_dict() for avg in averaged]
    for rank, (outputs, averages) in enumerate(get_world(2).run(_averaged_model)):
        for got, want in zip(outputs, want_out):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for got, want in zip(averages, want_avg):
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)


def _at_another_tp_size(group):
    """Per-rank files of TP 2 loaded into a TP 1 model and a fresh optimizer on each rank."""
    model = _model(group, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 0, 2)
    model_file, optim_file = _saved(model.state_dict()), _saved(optimizer.state_dict())
    single = _model(None, seed=1)
    errors = []
    try:
        single.load_state_dict(_loaded(model_file))
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        errors.append(f"{type(e).__name__}: {e}")
    optimizer = torch.optim.AdamW(single.parameters(), lr=1e-2)
    optimizer.load_state_dict(_loaded(optim_file))
    try:
        _train(single, optimizer, 2, 1)
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")
    return errors


def test_per_rank_state_at_another_tp_size_is_refused_naming_the_route():
    for rank, errors in enumerate(get_world(2).run(_at_another_tp_size)):
        assert len(errors) == 2, f"rank {rank}: {errors}"
        model_error, optim_error = errors
        assert "ColumnParallelLinear '0'" in model_error and "load_checkpoint" in model_error, model_error
        assert "optimizer state 'exp_avg' of parameter 0 (shape (32, 8))" in optim_error, optim_error
        assert "ColumnParallelLinear.weight', sharded at TP size 1" in optim_error, optim_error
        assert "set_state_dict" in optim_error and "load_checkpoint" in optim_error, optim_error


def _into_the_dense_model(group):
    model = _model(group, seed=0)
    dense = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)).double()
    try:
        dense.load_state_dict(model.state_dict())  # the naive route: torch refuses the labelled shards
        naive = "loaded"
    except RuntimeError as e:
        naive = str(e)
    dense.load_state_dict(tplayers.io.dense_state_dict(model))  # the route docs/models.md names
    whole = {k: v for k, v in tplayers.io.dense_state_dict(model).items()}
    return naive, all(torch.equal(whole[k], v) for k, v in dense.state_dict().items())


def test_the_dense_model_takes_dense_state_dict_not_the_labelled_shards():
    """docs/models.md: the dense model loading a TP model's state_dict() fails in torch's load (a wrong number if it
    ever took a shard as the whole); tplayers.io.dense_state_dict loads it."""
    for naive, equal in get_world(2).run(_into_the_dense_model):
        assert "mixed torch.Tensor and DTensor" in naive and "While copying the parameter named" in naive, naive
        assert equal
