"""Shipped plans, one file per model family: ``PLAN`` and its sequence-parallel ``SP_PLAN``.

A new family: add ``plans/<family>.py`` defining ``PLAN`` (and ``SP_PLAN`` with
:func:`~tplayers.convert.plan.sequence_parallel_variant`), then one line in each table below.
"""
from __future__ import annotations

from typing import Dict, Mapping, Union

from ..plan import Plan
from ..styles import Style
from . import bloom, falcon, gpt2, gpt_bigcode, llama, opt, persimmon, stablelm

__all__ = ["PLANS", "SP_PLANS", "MODEL_TYPES", "get_plan"]

#: The shipped plans by name (``parallelize(model, "llama", ...)``).
PLANS: Dict[str, Plan] = {"llama": llama.PLAN, "gpt2": gpt2.PLAN, "opt": opt.PLAN, "falcon": falcon.PLAN,
                          "bloom": bloom.PLAN, "gpt_bigcode": gpt_bigcode.PLAN, "persimmon": persimmon.PLAN,
                          "stablelm": stablelm.PLAN}
#: The shipped plans' sequence-parallel variants (``parallelize(model, "llama", ..., sequence_parallel=True)``).
SP_PLANS: Dict[str, Plan] = {"llama": llama.SP_PLAN, "gpt2": gpt2.SP_PLAN, "opt": opt.SP_PLAN}
# transformers' config.model_type -> the shipped plan "auto" uses for a model with no tp_plan of its own
MODEL_TYPES: Dict[str, str] = {"gpt2": "gpt2", "opt": "opt", "falcon": "falcon", "bloom": "bloom",
                               "gpt_bigcode": "gpt_bigcode", "persimmon": "persimmon", "stablelm": "stablelm"}


def get_plan(plan: Union[str, Plan, Mapping[str, Union[str, Style]]], *, sequence_parallel: bool = False) -> Plan:
    """A :class:`Plan` from a shipped plan's name, a Plan, or a ``{pattern: style}`` dict."""
    if sequence_parallel and not isinstance(plan, str):
        raise ValueError("parallelize: sequence_parallel=True selects a shipped plan's sequence-parallel variant; "
                         "in your own plan use Column/Row(sequence_parallel=True), 'scatter_sequence' and "
                         "'sequence_parallel_norm' styles")
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str):
        if plan not in PLANS:
            raise ValueError(f"parallelize: unknown plan '{plan}'; shipped plans: {sorted(PLANS)}, or 'auto' (a "
                             "Hugging Face model's own tp_plan)")
        if sequence_parallel and plan not in SP_PLANS:
            raise ValueError(f"parallelize: plan '{plan}' has no sequence-parallel variant (those with one: "
                             f"{sorted(SP_PLANS)}); use sequence_parallel=False")
        return SP_PLANS[plan] if sequence_parallel else PLANS[plan]
    if isinstance(plan, Mapping):
        return Plan(layers=dict(plan))
    raise TypeError(f"parallelize: plan must be a plan name, a Plan or a dict, got {type(plan).__name__}")
