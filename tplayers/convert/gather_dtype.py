"""`CastGather`: under autocast, a module's sequence gather (`GatherSequence`) sends the autocast dtype when only
column layers read what it gathers.

HF attention gathers its input because it views q/k/v with its input's ``(b, s)``; its q/k/v then cast the
gathered float32 sequence to bfloat16 (autocast's cast, each layer's own). The cast commutes with the gather,
so gathering the shard already cast gives the same bits at half the bytes, provided nothing else reads the
gathered values in float32 (an attention adding ``tanh(hidden_states)`` would read other numbers).

    Before (bf16 autocast, float32 weights)          Now
    x_full = all_gather(x)          # float32         x_full = all_gather(x.to(bf16))   # half the bytes
    q = q_proj(x_full)              # casts to bf16   q = q_proj(x_full)                # the same bits

Who reads it is watched, not assumed: the first forward under autocast gathers in float32 while a
``TorchFunctionMode`` looks at every torch call on the gathered tensor (and its views) until the module's
forward and its forward hooks return. Metadata, casts to the autocast dtype, autocast's lower-precision ops (``linear``,
``matmul``...) and tplayers' own code (the column layers) read what the cast gathers too; any other call reads
other values, and the module keeps its float32 gather. Every rank runs the same code, so every rank decides
the same. Cost: that first forward's Python call per torch op inside the module; nothing later.
"""
from __future__ import annotations

import sys
from typing import Any, List, Optional, Set

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..core.functional import autocast_dtype
from ..layers.base import has_foreign_hooks
from ..layers.siblings import COLUMN_KINDS
from ..regions.partial_sum import METADATA

__all__ = ["CastGather", "SortGather"]

# autocast runs these in its lower precision: reading the cast values is what they do anyway
_LOWER_PRECISION = frozenset({torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                              torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum,
                              torch.nn.functional.scaled_dot_product_attention})
_VIEWS = frozenset({torch.Tensor.__getitem__, torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.narrow,
                    torch.Tensor.transpose, torch.Tensor.unsqueeze, torch.Tensor.contiguous, torch.Tensor.detach})


def _from_tplayers(frame: Any, package: str = "tplayers") -> bool:
    """Whether the first caller outside torch is tplayers' own code (a column layer reading its input), of
    ``package`` (``tplayers.core``: the column path itself)."""
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module != __name__ and module != "torch" and not module.startswith("torch."):
            return module == package or module.startswith(package + ".")
        frame = frame.f_back
    return False


class _Readers(TorchFunctionMode):
    """Records the torch calls that read the watched tensors' values other than as the cast would (``dtype`` None:
    other than tplayers' own code, whatever the call)."""

    def __init__(self, watched: torch.Tensor, dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        self.ids: Set[int] = {id(watched)}
        self.kept: List[torch.Tensor] = [watched]  # (ids stay theirs while watched)
        self.dtype = dtype
        self.other: List[str] = []  # the calls that read other values

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in METADATA or not any(isinstance(a, torch.Tensor) and id(a) in self.ids
                                       for a in tree_leaves((args, kwargs))):
            return out
        if self.dtype is None:  # (the token order: a view of another order is other values too)
            if not _from_tplayers(sys._getframe(1), "tplayers.core"):
                self.other.append(getattr(func, "__name__", str(func)))
            return out
        if func in _VIEWS and isinstance(out, torch.Tensor):
            self.ids.add(id(out))
            self.kept.append(out)
        elif func in _LOWER_PRECISION or _from_tplayers(sys._getframe(1)):
            pass
        elif func in (torch.Tensor.to, torch.Tensor.type) and isinstance(out, torch.Tensor) and out.dtype == self.dtype:
            pass
        else:
            self.other.append(getattr(func, "__name__", str(func)))
        return out


class _Watcher:
    """A module's first qualifying forward watched (:class:`_Readers` over the tensor it gathered), then a verdict:
    :meth:`decide` of the calls that read other values, once the forward and its hooks return."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.watching: Optional[_Readers] = None
        self.handle: Any = None

    def _start(self, x_full: torch.Tensor, dtype: Optional[torch.dtype]) -> None:
        self.watching = _Readers(x_full, dtype)
        self.watching.__enter__()
        # registered now, so it runs after every forward hook the module has (they may read the input too)
        self.handle = self.module.register_forward_hook(self._stop, always_call=True)

    def _stop(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.watching is None:
            return
        watching, self.watching = self.watching, None
        self.handle.remove()
        watching.__exit__(None, None, None)
        if sys.exc_info()[0] is None:  # (a forward that raised decides nothing)
            self.decide(watching.other)

    def decide(self, other: List[str]) -> None:
        raise NotImplementedError


class CastGather(_Watcher):
    """One module's choice: gather in float32 and watch (the first forward under autocast), then in autocast's
    dtype where only column layers read the gathered sequence, else in float32 for good."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.cast_ok: Optional[bool] = None  # None: not watched yet

    def before(self, x: torch.Tensor) -> Optional[torch.dtype]:
        """The dtype to cast the shard to before the gather, or None (gather ``x`` as it is)."""
        dtype = autocast_dtype(x)
        if dtype is None or x.dtype == dtype or not x.is_floating_point() or torch.compiler.is_compiling():
            return None
        return dtype if self.cast_ok else None

    def watch(self, x_full: torch.Tensor) -> None:
        """After a float32 gather under autocast, the first time: watch the module's forward."""
        dtype = autocast_dtype(x_full)
        if self.cast_ok is not None or dtype is None or x_full.dtype == dtype or self.watching is not None \
                or torch.compiler.is_compiling():
            return
        self._start(x_full, dtype)

    def decide(self, other: List[str]) -> None:
        self.cast_ok = not other


class SortGather(_Watcher):
    """One module's choice of its sequence gather's token order (``comm.gather_sequence_for_columns(rank_major=)``):
    the sequence's while watched (its first forward with a backward to come, as :class:`CastGather` watches), then
    the collective's own rank-major order, no copy, where only metadata reads and tplayers' column layers read the
    gathered tensor (HF attention: its shape, then q / k / v), those layers together are narrower than the input
    (each puts its ``out/p`` features back in the sequence's order instead of the whole input) and, at that call,
    neither the module, its submodules nor the global module hooks hold a hook tplayers did not register (code that
    would see the rank-major tensor). A module whose submodules or forward change (a LoRA wrapper put in, a forward
    patched on its class or set on it) is watched again."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.ok: Optional[bool] = None  # None: not watched yet
        self.seen: List[Any] = []  # the module's forward and submodules when watched
        self.columns: List[nn.Module] = []  # its column layers then

    def rank_major(self, x: torch.Tensor) -> bool:
        """Whether to gather the shard ``x`` ``(b, s/p, h)`` in rank-major order at this call."""
        if not self.ok or torch.compiler.is_compiling() or not (torch.is_grad_enabled() and x.requires_grad) \
                or x.dim() < 3 or x.numel() == x.shape[-2] * x.shape[-1]:  # (one sequence: the same memory)
            return False
        modules = list(self.module.modules())
        if self._seen(modules) != self.seen:
            self.ok = None  # (watched again at the next forward)
            return False
        if any(getattr(m, "collective_matmul", False) or m.tp_invariant for m in self.columns) or \
                sum(m.weight.shape[0] for m in self.columns) >= x.shape[-1]:
            return False
        return not (has_foreign_hooks() or any(has_foreign_hooks(m) for m in modules))

    def watch(self, x_full: torch.Tensor) -> None:
        """After a gather in the sequence's order, the first time with a backward to come: watch the forward."""
        if self.ok is not None or self.watching is not None or torch.compiler.is_compiling() \
                or not (torch.is_grad_enabled() and x_full.requires_grad):
            return
        modules = list(self.module.modules())
        self.seen = self._seen(modules)
        self.columns = [m for m in modules if isinstance(m, COLUMN_KINDS)]
        self._start(x_full, None)

    def _seen(self, modules: List[nn.Module]) -> List[Any]:
        module = self.module
        return [type(module).forward, vars(module).get("forward"), *map(id, modules)]

    def decide(self, other: List[str]) -> None:
        self.ok = bool(self.columns) and not other
