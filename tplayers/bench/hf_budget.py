"""``tplayers bench --module hf:FAMILY``: a tiny Hugging Face causal LM of a shipped family, parallelized,
one forward + backward counted on every rank and held against its Megatron-layout budget
(:mod:`.budget`). Counted, not timed: the figures are deterministic (the collectives a step issues).

The model is built from a config (random weights, nothing downloaded) with the sizes asked for; the
first step runs uncounted (it holds the audit's own collectives, once per model), the second is
counted. ``parallelize(model, "auto")``; with ``sequence_parallel`` the family's shipped sequence-parallel
plan where it has one (Llama, GPT-2), else "auto"'s variant derived from the module tree (Qwen2, Mistral).
`megatron_budget_for_hf`: the budget of any Hugging Face causal LM, read off its config.
"""
from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
import contextlib
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..convert import parallelize
from ..convert.plans import SP_PLANS
from ..core.dtypes import DTYPES
from ..core.groups import GroupLike, resolve_group
from .accounting import comm_accounting
from .counts import StepCounts
from ..layers.base import TensorParallelModule
from .budget import CommBudget, megatron_budget

__all__ = ["HF_FAMILIES", "HFBudgetConfig", "run_hf_budget", "format_hf_budget", "BUDGET_SCHEMA",
           "megatron_budget_for_hf"]

BUDGET_SCHEMA = "tplayers-bench-budget/1"

# family -> (the config's model_type, its causal-LM class); the sizes are set in _config
HF_FAMILIES: Dict[str, Tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "gpt2": ("gpt2", "GPT2LMHeadModel"),
}


@dataclass(frozen=True)
class HFBudgetConfig:
    """What ``tplayers bench --module hf:FAMILY`` builds and runs."""

    family: str
    layers: int = 2
    batch: int = 2
    seq: int = 64
    hidden: int = 64
    ffn: int = 128
    heads: int = 4
    vocab: int = 256
    dtype: str = "float32"
    device: str = "cpu"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    seed: int = 0
    autocast: Optional[str] = None  # the step under torch.autocast of this dtype ("bfloat16", "float16")

    @property
    def plan(self) -> str:
        return self.family if self.sequence_parallel and self.family in SP_PLANS else "auto"

    def check(self, tp: int) -> None:
        """Clear errors, before any rank starts, for what cannot run."""
        if self.family not in HF_FAMILIES:
            raise ValueError(f"bench: no Hugging Face family {self.family!r}; known: {', '.join(HF_FAMILIES)}")
        if self.hidden % self.heads:
            raise ValueError(f"bench: hidden={self.hidden} is not divisible by heads={self.heads}")
        for name, value in (("heads", self.heads), ("ffn", self.ffn)):
            if value % tp:
                raise ValueError(f"bench: {name}={value} is not divisible by the TP degree {tp} (hf:{self.family})")
        if self.sequence_parallel and self.seq % tp:
            raise ValueError(f"bench: seq={self.seq} is not divisible by the TP degree {tp} (sequence parallel)")
        if self.autocast is not None and (self.autocast not in ("bfloat16", "float16") or self.dtype != "float32"):
            raise ValueError(f"bench: --autocast {self.autocast} runs a float32 model's step under torch.autocast "
                             f"(bfloat16 or float16); got --dtype {self.dtype}")


def _config(cfg: HFBudgetConfig) -> Any:
    from transformers import AutoConfig

    model_type, _ = HF_FAMILIES[cfg.family]
    if model_type == "gpt2":
        sizes = dict(n_embd=cfg.hidden, n_inner=cfg.ffn, n_layer=cfg.layers, n_head=cfg.heads, n_positions=cfg.seq,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)  # GPT-2's own (50256) lies outside a tiny vocabulary
    else:
        sizes = dict(hidden_size=cfg.hidden, intermediate_size=cfg.ffn, num_hidden_layers=cfg.layers,
                     num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, max_position_embeddings=cfg.seq,
                     tie_word_embeddings=False)
    return AutoConfig.for_model(model_type, vocab_size=cfg.vocab, **sizes)


def run_hf_budget(group: GroupLike, cfg: HFBudgetConfig) -> Dict[str, Any]:
    """On every rank: build, parallelize, one uncounted step, one counted; the comparison (JSON-ready) and its table."""
    import transformers

    g = resolve_group(group)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    torch.manual_seed(cfg.seed)
    model_class = getattr(transformers, HF_FAMILIES[cfg.family][1])
    model = model_class(_config(cfg)).to(device, DTYPES[cfg.dtype])
    model = parallelize(model, cfg.plan, group=g, sequence_parallel=cfg.sequence_parallel,
                        loss_parallel=cfg.loss_parallel)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(cfg.seed)).to(device)
    autocast = DTYPES[cfg.autocast] if cfg.autocast else None
    mixed = (lambda: torch.autocast(device.type, dtype=autocast)) if autocast else contextlib.nullcontext
    with mixed():
        model(ids, labels=ids).loss.backward()  # the first step: the audit's collectives (once per model)
    with comm_accounting(model) as acct, mixed():
        model(ids, labels=ids).loss.backward()
    with StepCounts() as counts, mixed():  # a steady-state step: what a GPU pays beside the collectives
        model(ids, labels=ids).loss.backward()
    budget = megatron_budget_for_hf(model, tuple(ids.shape), tp_size=g.size, sequence_parallel=cfg.sequence_parallel,
                                    loss_parallel=cfg.loss_parallel, dtype=autocast)
    comparison = acct.against(budget)
    report = {"schema": BUDGET_SCHEMA, "config": dict(asdict(cfg), module=f"hf:{cfg.family}", plan=cfg.plan),
              "environment": {"tp": g.size, "device": cfg.device, "torch": torch.__version__,
                              "transformers": transformers.__version__, "model": type(model).__name__,
                              "host": platform.node()},
              **comparison.as_dict(), "counts": counts.as_dict()}
    return {"report": report, "table": str(comparison), "budget": str(budget)}


def format_hf_budget(result: Dict[str, Any]) -> str:
    """The table ``tplayers bench --module hf:FAMILY`` prints."""
    c, env = result["report"]["config"], result["report"]["environment"]
    sp = " sequence-parallel" if c["sequence_parallel"] else ""
    loss = " loss-parallel" if c["loss_parallel"] else ""
    loss += f" under autocast({c['autocast']})" if c.get("autocast") else ""
    head = (f"tplayers bench: {c['module']} ({env['model']}, plan '{c['plan']}'{sp}{loss})  tp={env['tp']}  "
            f"{c['dtype']}  {env['device']}; one forward+backward with labels after a first step, collectives "
            "counted (not timed)")
    return "\n".join([head, "", result["table"], "", result["budget"], "", _counts_line(result["report"])])


def _counts_line(report: Dict[str, Any]) -> str:
    """One steady-state step's counts (tplayers.bench.counts), bytes moved in activations of the model's (b, s, h)."""
    c, counts = report["config"], report["counts"]
    activation = c["batch"] * c["seq"] * c["hidden"] * DTYPES[c["dtype"]].itemsize
    return (f"per step (this rank): {counts['kernels']} kernels, {counts['moved_bytes'] / activation:.2f} activations "
            f"of (b, s, h) moved by copies, casts and fills, {counts['gemm_flops'] / 1e9:.3g} GFLOP in GEMMs, "
            f"{counts['host_syncs']} host syncs ({', '.join(sorted(counts['host_syncs_by_op'])) or 'none'})")


# ---------------------------------------------------------------------------- the budget of a model


def megatron_budget_for_hf(model: nn.Module, input_shape: Sequence[int], *, tp_size: Optional[int] = None,
                           sequence_parallel: bool = False, loss_parallel: bool = False,
                           dtype: Optional[torch.dtype] = None) -> CommBudget:
    """`megatron_budget` of a Hugging Face causal LM (dense or parallelized) on ``input_ids`` of shape
    ``input_shape`` = (batch, seq), reading ``num_hidden_layers``, ``hidden_size`` and ``vocab_size``
    from ``model.config``. ``tp_size``: default the TP degree of the model's TP layers;
    ``sequence_parallel`` / ``loss_parallel``: as given to ``parallelize``; ``dtype``: of the activations
    in the TP regions, default the model's floating-point parameters' (under ``torch.autocast``, its dtype:
    the embedding and the norms' gradients are then counted in the parameters' dtype, ``residual_dtype``).
    Under sequence parallelism the norms counted are the modules whose class name contains "Norm" and whose
    parameters are vectors of ``hidden_size``."""
    config = getattr(model, "config", None)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if getattr(config, k, None) is None]
    if missing:
        raise ValueError(f"megatron_budget_for_hf: {type(model).__name__} has no Hugging Face config with "
                         f"{', '.join(missing)} (model.config: {type(config).__name__})")
    if len(input_shape) != 2:
        raise ValueError(f"megatron_budget_for_hf: input_shape must be (batch, seq), got {tuple(input_shape)}")
    if tp_size is None:
        groups = {m.group.size for m in model.modules() if isinstance(m, TensorParallelModule)}
        if len(groups) != 1:
            raise ValueError("megatron_budget_for_hf: pass tp_size= (the model has "
                             f"{'no TP layers' if not groups else f'TP layers of sizes {sorted(groups)}'})")
        tp_size = groups.pop()
    floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
    param_dtype = floats[0] if floats else torch.float32
    dtype = param_dtype if dtype is None else dtype
    hidden = int(config.hidden_size)
    norm_params = _norm_params(model, hidden) if sequence_parallel else None
    return megatron_budget(layers=int(config.num_hidden_layers), batch=int(input_shape[0]), seq=int(input_shape[1]),
                           hidden=hidden, vocab=int(config.vocab_size), tp_size=tp_size, dtype=dtype,
                           sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, norm_params=norm_params,
                           kv_replicas=_kv_replicas(model, config, hidden, tp_size), residual_dtype=param_dtype)


def _kv_replicas(model: nn.Module, config: Any, hidden: int, tp_size: int) -> Optional[Tuple[int, int]]:
    """``(ranks sharing a KV head, k and v elements per rank per layer)`` when KV heads are replicated evenly
    (fewer than the ranks, dividing them); None otherwise. Biases: when the model's k projections have one."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if not heads or not kv or kv >= tp_size or tp_size % kv:
        return None
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    biased = any(n.rsplit(".", 1)[-1] == "k_proj" and getattr(m, "bias", None) is not None for n, m in model.named_modules())
    return tp_size // kv, 2 * head_dim * (hidden + int(biased))


def _norm_params(model: nn.Module, hidden: int) -> int:
    """Elements of the norms on the residual stream (``hidden``-wide vectors; a q/k norm over a head is not one)."""
    total = 0
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if "Norm" in type(module).__name__ and params and all(p.dim() == 1 and p.numel() == hidden for p in params):
            total += sum(p.numel() for p in params)
    return total
