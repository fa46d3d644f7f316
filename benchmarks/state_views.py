"""What labelling shards as shards costs (issue 39): a 4-layer Llama-like model's AdamW training step at TP 2
with the checks this change added on the step path (every column / row linear's look for a DDP over TP peers,
torch.optim's global step pre-hook that gives each optimizer its state hooks) against the same step with them
taken out (what the step was before: the parameters themselves are unchanged, plain local tensors), alternating
step by step in one process (`tplayers.bench.timing.time_steps`; paired median ratio and quartiles, slower rank).
Then the state views and checkpoints, each timed `--repeats` times (median, rank 0): `model.state_dict()` (DTensor
views) and `get_state_dict(model, optimizer)`; `tplayers.save_checkpoint` with and without the optimizer at TP 2,
`load_checkpoint(..., optimizer=)` at TP 4; PyTorch's route (`get_state_dict` + `dcp.save`) at TP 2.

Real gloo on this machine's cores; checkpoints in a temporary directory on local disk.

    PYTHONPATH=. python benchmarks/state_views.py [--repeats 20]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import warnings
from typing import Callable, Dict, Iterator, List

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import tplayers
import tplayers.core.functional as prepare  # (the linears' checks: the DDP look-up)
import tplayers.layers.optimizers as optimizers
from tplayers.bench.report import quartiles
from tplayers.bench.timing import time_steps
from tplayers.testing import World

VOCAB, BATCH, SEQ = 4096, 2, 128


def _model(group):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    torch.manual_seed(0)
    model = tplayers.parallelize(LlamaForCausalLM(config), "auto", group=group, audit=False, check_inputs=0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


@contextlib.contextmanager
def _without_new_checks() -> Iterator[None]:
    """The step as it was: no DDP look-up in the linears, no global optimizer step pre-hook."""
    check, handle = prepare.refuse_replicating_wrapper, optimizers._STEP_HOOK.pop()
    prepare.refuse_replicating_wrapper = lambda op, g: None
    handle.remove()
    try:
        yield
    finally:
        prepare.refuse_replicating_wrapper = check
        optimizers._STEP_HOOK.append(
            register_optimizer_step_pre_hook(optimizers._attach))


def _median_s(fn: Callable[[], object], repeats: int, group) -> float:
    times: List[float] = []
    for _ in range(repeats):
        tplayers.core.blocking.barrier(group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _steps(group, repeats: int) -> Dict[str, object]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    arms = {"labelled (this change)": _model(group), "before": _model(group)}

    def step(name: str) -> Callable[[], None]:
        model, optimizer = arms[name]

        def run() -> None:
            with _without_new_checks() if name == "before" else contextlib.nullcontext():
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return run

    # the added work itself: calls of the DDP look-up per step (counted) x its time per call (no DDP active)
    calls = [0]
    check = prepare.refuse_replicating_wrapper

    def counted(op, g):
        calls[0] += 1
        check(op, g)
    prepare.refuse_replicating_wrapper = counted
    step("labelled (this change)")()
    prepare.refuse_replicating_wrapper = check
    tp = arms["before"][0].model.layers[0].mlp.up_proj.group
    n = 200_000
    start = time.perf_counter()
    for _ in range(n):
        check("bench", tp)
    per_call_us = 1e6 * (time.perf_counter() - start) / n
    timings = time_steps({k: step(k) for k in arms}, group=group, iters=repeats, warmup=3)
    ms = {k: 1e3 * torch.tensor(t.times) for k, t in timings.items()}
    ratio = quartiles((ms["labelled (this change)"] / ms["before"]).tolist())
    model, optimizer = arms["labelled (this change)"]
    from torch.distributed.checkpoint.state_dict import get_state_dict

    views = {"model.state_dict()": _median_s(model.state_dict, repeats, group),
             "get_state_dict(model, optimizer)": _median_s(lambda: get_state_dict(model, optimizer), repeats, group)}
    return {"step_ms": {k: statistics.median(v.tolist()) for k, v in ms.items()}, "ratio": ratio, "views": views,
            "checks": (calls[0], per_call_us), "optimizer": _optimizer_steps(model, repeats)}


def _optimizer_steps(model, repeats: int) -> Dict[str, float]:
    """The design not taken, its clearest cost: AdamW's step (foreach, the default) over the model's parameters
    as plain tensors (this design) and with every sharded one a DTensor over the TP group (parameters as
    DTensors, torchtitan's way: the optimizer then runs through DTensor's dispatch). Local, no collective."""
    from torch.distributed.tensor import DTensor

    from tplayers.core.dtensors import as_dtensor
    from tplayers.layers import model_placements

    placements = model_placements(model)
    plain, labelled = [], []
    for name, p in model.named_parameters():
        local = torch.nn.Parameter(p.detach().clone())
        local.grad = torch.randn_like(local)
        plain.append(local)
        pl = placements.get(name)
        group = model.get_submodule(name.rpartition(".")[0]).group if pl is not None and pl.is_sharded else None
        if group is None or group.size == 1:
            labelled.append(local)
            continue
        dt = torch.nn.Parameter(as_dtensor(p.detach().clone(), pl, group))
        dt.grad = DTensor.from_local(local.grad.narrow(pl.dim, 0, dt.to_local().shape[pl.dim]).clone(),
                                     dt.device_mesh, dt.placements, run_check=False, shape=dt.shape,
                                     stride=dt.stride())
        labelled.append(dt)
    out = {}
    for name, params in (("plain parameters", plain), ("DTensor parameters", labelled)):
        opt = torch.optim.AdamW(params, lr=1e-4)
        for _ in range(3):
            opt.step()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def _save(group, root: str, repeats: int) -> Dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _model(group)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step()

    def dcp_route() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with warnings.catch_warnings():  # "Detected an existing checkpoint ... overwriting": each repeat
            warnings.simplefilter("ignore")
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/dcp")
    out = {"save_checkpoint(model)": _median_s(lambda: tplayers.save_checkpoint(model, f"{root}/model"), repeats,
                                                  group),
           "save_checkpoint(model, optimizer=)": _median_s(
               lambda: tplayers.save_checkpoint(model, f"{root}/full", optimizer=optimizer), repeats, group),
           "get_state_dict + dcp.save": _median_s(dcp_route, repeats, group)}
    return out


def _load(group, root: str, repeats: int) -> Dict[str, float]:
    model, optimizer = _model(group)
    return {"load_checkpoint(model)": _median_s(lambda: tplayers.load_checkpoint(model, f"{root}/model"), repeats,
                                                group),
            "load_checkpoint(model, optimizer=)": _median_s(
                lambda: tplayers.load_checkpoint(model, f"{root}/full", optimizer=optimizer), repeats, group)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    with World(2) as world:
        steps = world.run(_steps, args.repeats)[0]
    with tempfile.TemporaryDirectory() as root:
        with World(2) as world:
            saves = world.run(_save, root, max(3, args.repeats // 4))[0]
        with World(4) as world:
            loads = world.run(_load, root, max(3, args.repeats // 4))[0]
    print(f"TP 2 over gloo (CPU), Llama-like 4 layers (hidden 256, 8 heads, ffn 688, vocab {VOCAB}, batch {BATCH} x "
          f"{SEQ}, float32), AdamW step, {args.repeats} rounds, slower rank:")
    for k, v in steps["step_ms"].items():
        print(f"  step {k:24s} {v:7.1f} ms (median)")
    ratio, low, high = steps["ratio"]
    print(f"  paired ratio labelled / before {ratio:.3f}x (quartiles {low:.3f}-{high:.3f})")
    count, per_call = steps["checks"]
    print(f"  added work: {count} DDP look-ups per step x {per_call:.3f} us = {count * per_call:.1f} us per step "
          f"({100 * count * per_call * 1e-3 / steps['step_ms']['before']:.4f}% of the step)")
    for k, v in steps["optimizer"].items():
        print(f"  AdamW.step() alone, {k:22s} {1e3 * v:8.2f} ms (median, rank 0)")
    for k, v in steps["views"].items():
        print(f"  {k:34s} {1e3 * v:8.2f} ms (median, rank 0)")
    for k, v in {**saves, **loads}.items():
        where = "TP 4" if k.startswith("load") else "TP 2"
        print(f"  {k:34s} {1e3 * v:8.1f} ms at {where} (median, rank 0)")


if __name__ == "__main__":
    main()
