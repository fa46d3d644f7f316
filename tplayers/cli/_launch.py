"""Run a per-rank function on a TP group: under torchrun when its environment is present,
else on ranks spawned here (`tplayers.testing.World`)."""
from __future__ import annotations

import functools
import gc
import os
import sys
import threading
from datetime import timedelta
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core.blocking import barrier
from ..testing import World

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """True when torchrun (or any env:// launcher) started this process."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def default_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


WAIT_NOTICE_S = 5.0  # after this long without the peers, say what this process waits for


def _join_torchrun_world(backend: str, timeout_s: float) -> None:
    """``init_process_group(env://)``, saying on stderr after a few seconds what it waits for (torchrun
    variables left in an environment with no launcher would otherwise wait in silence), and giving up
    after ``timeout_s`` with an error that names the rendezvous."""
    where = (f"{os.environ.get('WORLD_SIZE')} ranks at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
             f"(this is RANK={os.environ.get('RANK')})")
    joined = threading.Event()

    def notice() -> None:
        if not joined.wait(WAIT_NOTICE_S):
            print(f"tplayers: waiting for {where}, as torchrun's variables say; giving up after {timeout_s:g} s "
                  "(--timeout). Not under a launcher? Unset RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.",
                  file=sys.stderr, flush=True)

    threading.Thread(target=notice, daemon=True, name="tplayers-rendezvous-notice").start()
    try:
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as e:  # the store's timeout (DistStoreError) or a refused connection
        raise SystemExit(f"tplayers: the torchrun rendezvous failed: {where}: {str(e).splitlines()[0]}") from None
    finally:
        joined.set()


def _torchrun_group(tp: Optional[int], backend: str, device: str, timeout_s: float) -> Any:
    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        _join_torchrun_world(backend, timeout_s)
    world = dist.get_world_size()
    tp = world if tp is None else tp
    if tp < 1 or world % tp:
        raise SystemExit(f"tplayers: --tp {tp} does not divide the torchrun world size {world}")
    if tp == world:
        return dist.group.WORLD
    group, _ = dist.new_subgroups(group_size=tp)  # consecutive ranks share a TP group
    return group


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    tp: Optional[int],
    device: str = "cpu",
    backend: Optional[str] = None,
    threads: int = 1,
    timeout_s: float = 600.0,
) -> Tuple[List[Any], bool]:
    """``fn(group, *args)`` on every rank of a TP group of size ``tp``.

    Returns (results, is_reporter). Spawned: every rank's result, and True. Under torchrun: this
    rank's result only, and whether this is global rank 0 (the one that prints). ``tp=None``
    means 2 when spawning and the whole world under torchrun.
    """
    backend = backend or default_backend(device)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tplayers: --device cuda, but torch.cuda.is_available() is False on this machine")
    if under_torchrun():
        if threads:
            torch.set_num_threads(threads)
        group = _torchrun_group(tp, backend, device, timeout_s)
        return [fn(group, *args)], dist.get_rank() == 0
    size = 2 if tp is None else tp
    if size < 1:
        raise SystemExit(f"tplayers: --tp must be >= 1, got {size}")
    if device == "cuda" and backend == "nccl" and size > torch.cuda.device_count():
        raise SystemExit(
            f"tplayers: --tp {size} with NCCL needs {size} GPUs, this machine has {torch.cuda.device_count()} "
            "(use --backend gloo for several ranks on one GPU, or torchrun across machines)"
        )
    with World(size, backend=backend, threads=threads, timeout=timeout_s,
               collective_timeout=min(timeout_s, 120.0)) as world:
        return world.run(functools.partial(_on_device, fn, device), *args), True


def _on_device(fn: Callable[..., Any], device: str, group: Any, *args: Any) -> Any:
    """``fn(group, *args)`` on a spawned rank, placed on its GPU first when ``device`` is cuda: rank % GPUs, as
    the NCCL ranks already are (gloo ranks otherwise all ran on the first GPU, whatever the machine had)."""
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return fn(group, *args)


def finish_torchrun() -> None:
    """Leave the process group this command joined: every rank first waits for the others (so no
    rank tears down its gloo pairs or the store rank 0 hosts while a peer still uses them), then
    destroys it and collects garbage while the interpreter is fully alive: a process group kept
    alive by a reference cycle until the finalizing gc aborts the process (see
    ``core.groups._destroy_gloo_groups``, which does the same at exit for any script)."""
    if under_torchrun() and dist.is_initialized():
        try:
            barrier(dist.group.WORLD)
        finally:
            dist.destroy_process_group()
            gc.collect()
