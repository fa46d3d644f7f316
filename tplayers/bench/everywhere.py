"""Other libraries' collectives on the emulated link: ``emulated_link(spec, everywhere=True)`` wraps
torch.distributed's and the functional collectives' entry points for the duration (benchmarks/peers.py
compares DTensor, megatron-core and fairscale over the same modeled wire). Bench-only: core never
patches torch."""
from __future__ import annotations

import time
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

__all__ = ["wrap_torch_distributed", "sleep_until"]


def sleep_until(end: float) -> None:
    left = end - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _group_size(group: Any) -> int:
    if isinstance(group, tuple):  # functional collectives: (DeviceMesh, mesh_dim)
        return group[0].size(group[1])
    if hasattr(group, "size") and not isinstance(group, dist.ProcessGroup):  # a 1-D DeviceMesh
        return group.size()
    return dist.get_world_size(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# name -> (op, bytes of the full buffer from (args, result), index of the group argument)
_TORCH_DISTRIBUTED = {
    "all_reduce": ("all_reduce", lambda a, r: _nbytes(a[0]), 2),
    "broadcast": ("broadcast", lambda a, r: _nbytes(a[0]), 2),
    "all_gather_into_tensor": ("all_gather", lambda a, r: _nbytes(a[0]), 2),
    "_all_gather_base": ("all_gather", lambda a, r: _nbytes(a[0]), 2),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, r: _nbytes(a[1]), 3),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, r: _nbytes(a[1]), 3),
}
_FUNCTIONAL = {  # torch.distributed._functional_collectives (DTensor): they return the result tensor
    "all_reduce": ("all_reduce", lambda a, r: _nbytes(a[0]), 2),
    "all_gather_tensor": ("all_gather", lambda a, r: _nbytes(r), 2),
    "all_gather_single": ("all_gather", lambda a, r: _nbytes(r), 2),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, r: _nbytes(a[0]), 3),
    "reduce_scatter_single": ("reduce_scatter", lambda a, r: _nbytes(a[0]), 3),
}


class _SlowWork:
    """A torch.distributed Work whose ``wait()`` also sleeps until the emulated link's modeled end."""

    def __init__(self, work: Any, end: float) -> None:
        self._work, self._end = work, end

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        sleep_until(self._end)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)




def wrap_torch_distributed(link: Any, *, inside: Callable[[], bool]) -> Callable[[], None]:
    """Route other libraries' collectives through the emulated ``link`` too (DTensor's functional
    collectives, megatron-core's and fairscale's torch.distributed calls): each completes no earlier
    than its modeled end (functional ones block until then: their waits are implicit). Returns the
    function that restores the originals. ``inside()``: whether a tplayers primitive is making the
    call (its own collectives are modeled once, by the observer)."""
    import torch.distributed._functional_collectives as funcol

    saved = []

    def install(module: Any, table: Dict[str, Any], functional: bool) -> None:
        for name, (op, nbytes_of, group_at) in table.items():
            original = getattr(module, name, None)
            if original is None:
                continue

            def wrapper(*args: Any, _original: Any = original, _op: str = op, _nbytes_of: Any = nbytes_of,
                        _group_at: int = group_at, **kwargs: Any) -> Any:
                if inside():
                    return _original(*args, **kwargs)
                t0 = time.perf_counter()
                result = _original(*args, **kwargs)
                group = kwargs.get("group", args[_group_at] if len(args) > _group_at else None)
                end = link.modeled_end(_op, _nbytes_of(args, result), group, _group_size(group), t0)
                if functional or result is None:  # blocking: the caller has it now
                    sleep_until(end)
                    return result
                return _SlowWork(result, end)

            saved.append((module, name, original))
            setattr(module, name, wrapper)

    install(dist, _TORCH_DISTRIBUTED, False)
    install(funcol, _FUNCTIONAL, True)

    def restore() -> None:
        for module, name, original in saved:
            setattr(module, name, original)

    return restore
