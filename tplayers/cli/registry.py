"""The registry of ``tplayers verify`` checks: what a check is, how one registers, how they are selected.

A check is a function ``fn(group, cfg) -> MatchReport`` registered with :func:`register` (or, for
several variants of one builder, :func:`variant`, which binds the builder's keyword options).
"""
from __future__ import annotations

import fnmatch
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ..core.dtypes import DTYPES
from ..core.groups import TPGroup
from ..testing import MatchReport, default_tolerance

__all__ = ["VerifyConfig", "Check", "CheckResult", "CHECKS", "register", "variant", "select_checks", "tolerance",
           "LOW_PRECISION"]


@dataclass(frozen=True)
class VerifyConfig:
    dtype: str = "float64"
    device: str = "cpu"
    seed: int = 0
    batch: int = 2
    rtol: Optional[float] = None  # None: tplayers.testing.default_tolerance(dtype), see LOW_PRECISION
    atol: Optional[float] = None
    tol_scale: float = 1.0  # set per check by run_checks (Check.tol_scale)
    progress: bool = False  # a progress bar on rank 0's stderr
    model: Optional[str] = None  # --model pkg.module:build (your own model; see tplayers.cli.verify.user_model_check)
    plan: Optional[str] = None  # --plan pkg.module:PLAN (default "auto")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def torch_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")


@dataclass(frozen=True)
class Check:
    module: str  # what is checked, e.g. "ColumnParallelLinear"
    options: str  # how it is configured, e.g. "gather_output=True"
    fn: Callable[[TPGroup, VerifyConfig], MatchReport]
    tol_scale: float = 1.0  # low precision: how many default tolerances this (deeper) module gets

    @property
    def name(self) -> str:
        return f"{self.module}({self.options})" if self.options else self.module


@dataclass
class CheckResult:
    name: str
    tp: int
    forward_error: float
    grad_error: float
    passed: bool
    message: str = ""
    rtol: float = math.nan  # the tolerances the comparison used (tolerance(cfg) of this check)
    atol: float = math.nan


CHECKS: List[Check] = []


def register(module: str, options: str = "", *, tol_scale: float = 1.0) -> Callable:
    """Decorator adding a check ``fn(group, cfg) -> MatchReport`` to the registry.

    ``tol_scale``: in bfloat16/float16 the check compares with ``tol_scale`` times the dtype's
    default tolerance (chained matmuls and reductions round more); fp32/fp64 are never scaled."""
    def deco(fn: Callable[[TPGroup, VerifyConfig], MatchReport]) -> Callable:
        CHECKS.append(Check(module, options, fn, tol_scale))
        return fn
    return deco


def select_checks(patterns: Optional[Sequence[str]] = None) -> List[Check]:
    """Checks whose name matches any of the glob/substring ``patterns`` (all when None)."""
    if not patterns:
        return list(CHECKS)
    def hit(name: str, pat: str) -> bool:
        return fnmatch.fnmatch(name, pat) if any(c in pat for c in "*?[") else pat.lower() in name.lower()
    return [c for c in CHECKS if any(hit(c.name, p) for p in patterns)]


LOW_PRECISION = (torch.bfloat16, torch.float16)


def tolerance(cfg: VerifyConfig) -> Tuple[float, float]:
    """(rtol, atol) a check compares with: the override, else the dtype's default (scaled in low precision)."""
    rtol, atol = default_tolerance(cfg.torch_dtype)
    if cfg.torch_dtype in LOW_PRECISION:
        rtol, atol = rtol * cfg.tol_scale, atol * cfg.tol_scale
    return (rtol if cfg.rtol is None else cfg.rtol), (atol if cfg.atol is None else cfg.atol)


def variant(module: str, options: str, fn: Callable[..., MatchReport], *, tol_scale: float = 1.0,
             **kwargs: Any) -> None:
    """Register ``fn(group, cfg, **kwargs)`` as the check ``module(options)``."""
    register(module, options, tol_scale=tol_scale)(functools.partial(fn, **kwargs))
