"""TP at any size on one process: ``tplayers bench --simulate --tp 8``.

One rank of a TP group of ``p`` runs in this process on a ``fake`` process group (torch's test
backend: collectives return at once and move nothing). Its compute is real: the sharded module
at one rank's shapes. Its collectives are timed by an emulated link (`tplayers.emulated_link`):
each completes at launch (or the previous collective's end) + its alpha-beta time, so overlap and
exposure come out as on a real rank whose peers keep pace (on a GPU, ``--device cuda``: the link
runs on the GPU's timeline, see `tplayers.bench.accounting`). Outputs are meaningless (nothing is
summed): only the times, counts, bytes and memory are. Every rank of a real TP group does the same
work, so one rank stands for all (no stragglers, no contention between groups: see the docs).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Dict, Iterator, Set

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core.dtypes import DTYPES
from ..core.groups import resolve_group
from .modules import MODULES, tp_model
from .config import BenchConfig
from .overlap import MODE_TABLE, BenchInputs, run_overlap_bench
from .predict import gpu_model, predict_modes, prediction_link

__all__ = ["simulate", "rank_memory", "predict", "simulated_rank"]


def rank_memory(model: nn.Module, x: torch.Tensor) -> Dict[str, int]:
    """Bytes of ``model``'s parameters on this rank, and of the activations its forward saves for
    backward (each storage counted once, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: Set[int] = set()
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            saved[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return {"param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "activation_bytes": saved[0]}


def simulate(cfg: BenchConfig, tp: int) -> Dict[str, Any]:
    """The benchmark report of one simulated rank of TP ``tp`` (``cfg.link`` required), with
    ``summary.step_ms`` and a ``simulation`` section (memory per rank, what was simulated)."""
    if cfg.link is None:
        raise ValueError("bench --simulate needs --link (the collectives' timing comes from the link model)")
    if tp < 1:
        raise ValueError(f"bench --simulate: --tp must be >= 1, got {tp}")
    cfg.check_tp(tp)
    modes = tuple(m for m in cfg.modes if m not in ("naive", "dense"))  # no peers; the dense layer is not one rank's
    cfg = replace(cfg, modes=modes)
    with simulated_rank(tp) as group:
        report = run_overlap_bench(group, cfg)
        torch.manual_seed(cfg.seed)
        device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
        dense = MODULES[cfg.module].dense(cfg).to(device, DTYPES[cfg.dtype])
        model = tp_model(dense, cfg, resolve_group(group), True)
        seq = cfg.seq // tp if cfg.sequence_parallel else cfg.seq
        param = next(model.parameters())
        x = torch.randn(cfg.batch, seq, cfg.hidden, device=param.device, dtype=param.dtype, requires_grad=True)
        memory = rank_memory(model, x)
    t = report["timings"]
    if "tp" in t:
        report["summary"]["step_ms"] = t["tp"]["median_ms"]
    report["simulation"] = {"tp": tp, "rank": 0, "backend": "fake", **memory,
                            "note": "one rank's real compute; collectives timed by the link model"}
    report["environment"]["backend"] = "fake (simulated)"
    return report


@contextmanager
def simulated_rank(tp: int) -> Iterator[Any]:
    """Rank 0 of a TP ``tp`` world, alone in this process: the fake process group (torch's testing backend: its
    collectives return at once and move nothing), so one rank's share of every op runs here. Yields the group; it is
    destroyed on leaving. Refused where a process group exists already (under torchrun)."""
    if dist.is_initialized():
        raise RuntimeError("bench --simulate creates its own one-process group: run it outside torchrun")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def predict(cfg: BenchConfig, tp: int, gpu_name: str) -> Dict[str, Any]:
    """A PREDICTION of each mode's step for one rank of TP ``tp`` on the GPU ``gpu_name`` (``tplayers bench --simulate
    --predict GPU``): every mode's step recorded on the meta device (shapes only: a real layer's step at any size
    in a second, no compute) on the fake process group, replayed on a model of the GPU and ``cfg.link``
    (:mod:`.predict`), with each mode's counts (:mod:`.counts`). Nothing is timed."""
    gpu = gpu_model(gpu_name)
    if cfg.link is None:
        raise ValueError("bench --predict needs --link (the collectives' times come from the link model)")
    link = prediction_link(cfg.link)
    cfg.check_tp(tp)
    cfg = replace(cfg, device="meta", modes=tuple(m for m in cfg.modes if m not in ("naive", "dense")))
    with simulated_rank(tp) as group:
        inputs = BenchInputs.create(resolve_group(group), cfg)
        steps, skipped = {}, {}
        for name in cfg.modes:
            why = MODE_TABLE[name].skip(inputs)
            if why is not None:
                skipped[name] = why
                continue
            steps[name] = MODE_TABLE[name].build(inputs)
        prediction = predict_modes(steps, gpu, link)
    return {"schema": "tplayers-bench-predict/1", "config": {**vars(cfg), "modes": list(cfg.modes)}, "tp": tp,
            "prediction": prediction, "counts": prediction.pop("counts"), "skipped": skipped}
