"""``tplayers verify``: every TP module against its dense reference, as a table and an exit status.

A check is a function ``fn(group, cfg) -> MatchReport`` registered with :func:`register`
(variants of one builder: ``_variant``, which binds the builder's keyword options). It builds the dense reference and the TP module from the same seeded full
weights and calls :func:`tplayers.testing.assert_matches_dense` (outputs, input gradients,
gathered parameter gradients). Every rank runs every selected check; the ranks agree on each
result, so the table and the exit status are the same everywhere.

Shapes scale with the TP degree p (hidden 16p, ffn 32p, seq 4p, 2p heads of 8, vocab 8p or
8p+3 for the padded embedding) so every check fits every p.
"""
from __future__ import annotations

import fnmatch
import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.dtypes import DTYPES
from ..models.blocks import ParallelAttention, ParallelMLP, ParallelTransformerBlock
from ..core.comm import all_gather_tensor
from ..models.dense import BlockConfig, DenseAttention, DenseGPT, DenseMLP, DenseTransformerBlock, GPTConfig
from ..layers.vocab import ParallelLMHead, VocabParallelEmbedding
from ..models.gpt import ParallelGPT
from ..core.groups import TPGroup, resolve_group
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..models.loss import vocab_parallel_cross_entropy
from ..testing import MatchReport, assert_matches_dense, default_tolerance

__all__ = ["VerifyConfig", "Check", "CheckResult", "CHECKS", "register", "select_checks", "run_checks", "tolerance",
           "merge_rank_results", "format_table", "report_json", "exit_code"]



@dataclass(frozen=True)
class VerifyConfig:
    dtype: str = "float64"
    device: str = "cpu"
    seed: int = 0
    batch: int = 2
    rtol: Optional[float] = None  # None: tplayers.testing.default_tolerance(dtype), see LOW_PRECISION
    atol: Optional[float] = None
    tol_scale: float = 1.0  # set per check by run_checks (Check.tol_scale)

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


# ---------------------------------------------------------------------------- shapes and helpers


def _dims(g: TPGroup) -> Dict[str, int]:
    p = g.size
    return dict(seq=4 * p, hidden=16 * p, ffn=32 * p)


def _input(cfg: VerifyConfig, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).to(cfg.torch_device(), cfg.torch_dtype)


def _dense(module: nn.Module, cfg: VerifyConfig) -> nn.Module:
    return module.to(cfg.torch_device(), cfg.torch_dtype)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def tolerance(cfg: VerifyConfig) -> Tuple[float, float]:
    """(rtol, atol) a check compares with: the override, else the dtype's default (scaled in low precision)."""
    rtol, atol = default_tolerance(cfg.torch_dtype)
    if cfg.torch_dtype in LOW_PRECISION:
        rtol, atol = rtol * cfg.tol_scale, atol * cfg.tol_scale
    return (rtol if cfg.rtol is None else cfg.rtol), (atol if cfg.atol is None else cfg.atol)


def _match(tp: nn.Module, dense: nn.Module, x: Any, g: TPGroup, cfg: VerifyConfig, **kw: Any) -> MatchReport:
    rtol, atol = tolerance(cfg)
    return assert_matches_dense(tp, dense, x, group=g, rtol=rtol, atol=atol, seed=cfg.seed, **kw)


def _variant(module: str, options: str, fn: Callable[..., MatchReport], *, tol_scale: float = 1.0,
             **kwargs: Any) -> None:
    """Register ``fn(group, cfg, **kwargs)`` as the check ``module(options)``."""
    register(module, options, tol_scale=tol_scale)(functools.partial(fn, **kwargs))


def _seq_shards(sp: bool) -> Dict[str, Any]:
    """assert_matches_dense's shard dims for a module whose input and output are (b, s | s/p, h)."""
    return dict(input_shard_dims=[-2] if sp else None, output_shard_dim=-2 if sp else None)


# ---------------------------------------------------------------------------- the checks: linears


def _column(g: TPGroup, cfg: VerifyConfig, **options: Any) -> MatchReport:
    d = _dims(g)
    dense = _dense(nn.Linear(d["hidden"], d["ffn"]), cfg)
    tp = ColumnParallelLinear.from_dense(dense, group=g, **options)
    return _match(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                  input_shard_dims=[-2] if options.get("sequence_parallel") else None,
                  output_shard_dim=None if options.get("gather_output") else -1)


def _row(g: TPGroup, cfg: VerifyConfig, **options: Any) -> MatchReport:
    d = _dims(g)
    dense = _dense(nn.Linear(d["ffn"], d["hidden"]), cfg)
    tp = RowParallelLinear.from_dense(dense, group=g, **options)
    return _match(tp, dense, _input(cfg, cfg.batch, d["seq"], d["ffn"]), g, cfg,
                  input_shard_dims=[-1] if options.get("input_is_parallel", True) else None,
                  output_shard_dim=-2 if options.get("sequence_parallel") else None)


def _mlp_pair(g: TPGroup, cfg: VerifyConfig, act: bool, **options: Any) -> MatchReport:
    d = _dims(g)
    layers = [nn.Linear(d["hidden"], d["ffn"]), nn.GELU(), nn.Linear(d["ffn"], d["hidden"])]
    dense = _dense(nn.Sequential(*(layers if act else [layers[0], layers[2]])), cfg)
    fc1, fc2 = dense[0], dense[-1]
    middle = [nn.GELU()] if act else []
    tp = nn.Sequential(ColumnParallelLinear.from_dense(fc1, group=g, **options), *middle,
                       RowParallelLinear.from_dense(fc2, group=g, **options))
    return _match(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                  **_seq_shards(options.get("sequence_parallel", False)))


_variant("ColumnParallelLinear", "gather_output=False", _column)
_variant("ColumnParallelLinear", "gather_output=True", _column, gather_output=True)
_variant("ColumnParallelLinear", "overlap_comm=False", _column, overlap_comm=False)
_variant("ColumnParallelLinear", "sequence_parallel=True", _column, sequence_parallel=True)
_variant("RowParallelLinear", "input_is_parallel=True", _row)
_variant("RowParallelLinear", "input_is_parallel=False", _row, input_is_parallel=False)
_variant("RowParallelLinear", "sequence_parallel=True", _row, sequence_parallel=True)
_variant("Column->Row", "sequence_parallel=True", _mlp_pair, tol_scale=2, act=False, sequence_parallel=True)
_variant("Column->GELU->Row MLP", "", _mlp_pair, tol_scale=2, act=True)
_variant("Column->GELU->Row MLP", "overlap_comm=False", _mlp_pair, tol_scale=2, act=True, overlap_comm=False)
_variant("Column->GELU->Row MLP", "sequence_parallel=True", _mlp_pair, tol_scale=2, act=True, sequence_parallel=True)


# ---------------------------------------------------------------------------- the checks: vocab, blocks


class _CrossEntropy(nn.Module):
    """Dense reference: F.cross_entropy over full logits ``(b, s, V)`` for fixed targets ``(b, s)``."""

    def __init__(self, target: torch.Tensor, **options: Any) -> None:
        super().__init__()
        self.target, self.options = target, options

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, -2), self.target.flatten(), **self.options)
        return loss.view(self.target.shape) if self.options.get("reduction") == "none" else loss


class _VocabParallelCrossEntropy(nn.Module):
    """vocab_parallel_cross_entropy on this rank's logits shard ``(b, s, V/p)``."""

    def __init__(self, target: torch.Tensor, g: TPGroup, **options: Any) -> None:
        super().__init__()
        self.target, self.g, self.options = target, g, options

    def forward(self, logits_shard: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_shard, self.target, group=self.g, **self.options)


def _cross_entropy(g: TPGroup, cfg: VerifyConfig, **options: Any) -> MatchReport:
    d = _dims(g)
    vocab = 8 * g.size
    logits = _input(cfg, cfg.batch, d["seq"], vocab) * 3  # (b, s, V)
    target = torch.randint(0, vocab, (cfg.batch, d["seq"]), device=cfg.torch_device())  # (b, s)
    if "ignore_index" in options:
        target[0, 0] = options["ignore_index"]
    return _match(_VocabParallelCrossEntropy(target, g, **options), _CrossEntropy(target, **options), logits, g, cfg,
                  input_shard_dims=[-1])


_variant("vocab_parallel_cross_entropy", "reduction='none'", _cross_entropy, reduction="none")
_variant("vocab_parallel_cross_entropy", "mean, label_smoothing=0.1, ignore_index", _cross_entropy,
         reduction="mean", label_smoothing=0.1, ignore_index=-100)


def _embedding(g: TPGroup, cfg: VerifyConfig, **options: Any) -> MatchReport:
    d = _dims(g)
    vocab = 8 * g.size + 3  # not divisible by p > 1: exercises the padded last shard
    dense = _dense(nn.Embedding(vocab, d["hidden"]), cfg)
    tp = VocabParallelEmbedding.from_dense(dense, group=g, **options)
    ids = torch.randint(0, vocab, (cfg.batch, d["seq"]), device=cfg.torch_device())  # (b, s)
    sp = options.get("sequence_parallel", False)
    return _match(tp, dense, ids, g, cfg, output_shard_dim=-2 if sp else None)


_variant("VocabParallelEmbedding", "vocab=8p+3", _embedding)
_variant("VocabParallelEmbedding", "vocab=8p+3, sequence_parallel=True", _embedding, sequence_parallel=True)


def _lm_head(g: TPGroup, cfg: VerifyConfig, padded: bool, sp: bool, **options: Any) -> MatchReport:
    d = _dims(g)
    vocab = 8 * g.size + (3 if padded else 0)  # without padding the gathered shards are the dense logits
    dense = _dense(nn.Linear(d["hidden"], vocab, bias=False), cfg)
    tp = ParallelLMHead.from_dense(dense, group=g, sequence_parallel=sp, **options)
    gathered = options.get("gather_output", False)
    return _match(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                  input_shard_dims=[-2] if sp else None, output_shard_dim=None if gathered else -1)


_variant("ParallelLMHead", "vocab=8p+3, gather_output=True", _lm_head, padded=True, sp=False, gather_output=True)
_variant("ParallelLMHead", "vocab=8p, logits shard, sequence_parallel=True", _lm_head, padded=False, sp=True)


class _TiedLM(nn.Module):
    """``head(tanh(embed(ids)))`` with ``head.weight`` tied to ``embed.weight``. The head is kept out
    of the module tree so the one shared parameter is named ``embed.weight`` in both the dense
    and the TP model (its gradient holds both uses)."""

    def __init__(self, embed: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.embed = embed
        head.weight = embed.weight
        object.__setattr__(self, "head", head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))  # (b, s, V)


@register("VocabParallelEmbedding+ParallelLMHead", "tied weight, vocab=8p+3", tol_scale=2)
def check_tied_embedding(g: TPGroup, cfg: VerifyConfig) -> MatchReport:
    d = _dims(g)
    vocab = 8 * g.size + 3
    dense = _TiedLM(_dense(nn.Embedding(vocab, d["hidden"]), cfg), _dense(nn.Linear(d["hidden"], vocab, bias=False), cfg))
    tp = _TiedLM(VocabParallelEmbedding.from_dense(dense.embed, group=g),
                 ParallelLMHead.from_dense(dense.head, group=g, gather_output=True))
    if tp.head.weight is not tp.embed.weight:
        raise AssertionError("the TP head and embedding do not share one weight")
    ids = torch.randint(0, vocab, (cfg.batch, d["seq"]), device=cfg.torch_device())  # (b, s)
    return _match(tp, dense, ids, g, cfg)


def _parallel_mlp(g: TPGroup, cfg: VerifyConfig, activation: str, sp: bool) -> MatchReport:
    d = _dims(g)
    dense = _dense(DenseMLP(d["hidden"], d["ffn"], activation), cfg)
    tp = ParallelMLP.from_dense(dense, group=g, sequence_parallel=sp)
    return _match(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                  **_seq_shards(sp))


_variant("ParallelMLP", "gelu", _parallel_mlp, tol_scale=2, activation="gelu", sp=False)
_variant("ParallelMLP", "swiglu", _parallel_mlp, tol_scale=2, activation="swiglu", sp=False)
_variant("ParallelMLP", "swiglu, sequence_parallel=True", _parallel_mlp, tol_scale=2, activation="swiglu", sp=True)


def _heads(g: TPGroup) -> Dict[str, int]:
    # 2 query heads per rank, head_dim 8; GQA: half as many KV heads as ranks (replicated KV heads)
    return dict(n_heads=2 * g.size, n_kv_heads=max(1, g.size // 2))


def _attention(g: TPGroup, cfg: VerifyConfig, gqa: bool, sp: bool, rotary: bool) -> MatchReport:
    d, h = _dims(g), _heads(g)
    dense = _dense(DenseAttention(d["hidden"], h["n_heads"], h["n_kv_heads"] if gqa else None,
                                  causal=True, rotary=rotary), cfg)
    tp = ParallelAttention.from_dense(dense, group=g, sequence_parallel=sp)
    return _match(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                  **_seq_shards(sp))


_variant("ParallelAttention", "MHA, causal", _attention, tol_scale=8, gqa=False, sp=False, rotary=False)
_variant("ParallelAttention", "GQA (kv heads = p/2), causal, rotary", _attention, tol_scale=8,
         gqa=True, sp=False, rotary=True)
_variant("ParallelAttention", "GQA, rotary, sequence_parallel=True", _attention, tol_scale=8,
         gqa=True, sp=True, rotary=True)


def _block(g: TPGroup, cfg: VerifyConfig, sp: bool, llama: bool) -> MatchReport:
    d, h = _dims(g), _heads(g)
    config = BlockConfig(hidden=d["hidden"], n_heads=h["n_heads"], ffn_hidden=d["ffn"],
                         n_kv_heads=h["n_kv_heads"] if llama else None, activation="swiglu" if llama else "gelu",
                         norm="rmsnorm" if llama else "layernorm", bias=not llama, rotary=llama)
    dense = _dense(DenseTransformerBlock(config), cfg)
    with torch.no_grad():  # non-trivial norm weights, so their gradients are checked for real
        for name, p in dense.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    tp = ParallelTransformerBlock.from_dense(dense, group=g, sequence_parallel=sp)
    return _match(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                  **_seq_shards(sp))


_variant("ParallelTransformerBlock", "GPT: gelu, layernorm, MHA", _block, tol_scale=16, sp=False, llama=False)
_variant("ParallelTransformerBlock", "GPT, sequence_parallel=True", _block, tol_scale=16, sp=True, llama=False)
_variant("ParallelTransformerBlock", "Llama: swiglu, rmsnorm, GQA, rotary", _block, tol_scale=16, sp=False, llama=True)
_variant("ParallelTransformerBlock", "Llama, sequence_parallel=True", _block, tol_scale=16, sp=True, llama=True)


class _Call(nn.Module):
    """``model.<method>(ids, *args)`` as a module (names its parameters ``model.*`` on both sides)."""

    def __init__(self, model: nn.Module, method: str, *args: Any) -> None:
        super().__init__()
        self.model, self.method, self.args = model, method, args

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return getattr(self.model, self.method)(ids, *self.args)


def _gpt(g: TPGroup, cfg: VerifyConfig, what: str, sp: bool) -> MatchReport:
    d, h = _dims(g), _heads(g)
    vocab = 8 * g.size + 3  # padded vocabulary: the loss must keep the padding out
    config = GPTConfig(hidden=d["hidden"], n_heads=h["n_heads"], ffn_hidden=d["ffn"], n_kv_heads=h["n_kv_heads"],
                       vocab_size=vocab, n_layers=2)
    dense = _dense(DenseGPT(config), cfg)
    tp = ParallelGPT.from_dense(dense, group=g, sequence_parallel=sp)
    ids = torch.randint(0, vocab, (cfg.batch, d["seq"]), device=cfg.torch_device())  # (b, s)
    if what == "logits":  # the full (b, s, V) logits, gathered from the vocabulary shards
        return _match(_Call(tp, "logits"), _Call(dense, "forward"), ids, g, cfg)
    targets = torch.randint(0, vocab, (cfg.batch, d["seq"]), device=ids.device)  # (b, s)
    targets[0, 0] = -100  # ignored
    return _match(_Call(tp, "loss", targets), _Call(dense, "loss", targets), ids, g, cfg)


_variant("ParallelGPT", "logits, GQA, rotary, vocab=8p+3", _gpt, tol_scale=32, what="logits", sp=False)
_variant("ParallelGPT", "loss (vocab-parallel cross-entropy)", _gpt, tol_scale=32, what="loss", sp=False)
_variant("ParallelGPT", "loss, sequence_parallel=True", _gpt, tol_scale=32, what="loss", sp=True)


# ---------------------------------------------------------------------------- running and reporting


def _agree(g: TPGroup, values: List[float], device: torch.device) -> List[float]:
    """Element-wise max of ``values`` over the ranks of ``g`` (NaN wins)."""
    t = torch.tensor([values], dtype=torch.float64, device=device)
    if g.size > 1:
        t = all_gather_tensor(t, 0, group=g)  # (p, n)
    worst = t.nan_to_num(nan=-math.inf).amax(0)
    worst[t.isnan().any(0)] = math.nan
    return [float(v) for v in worst.cpu()]


def _attempt(check: Check, g: TPGroup, cfg: VerifyConfig) -> tuple:
    torch.manual_seed(cfg.seed)
    try:
        report = check.fn(g, cfg)
        return report.output_error, report.grad_error, ""
    except Exception as e:  # a mismatch (AssertionError) or an error building/running the module
        return math.nan, math.nan, f"{type(e).__name__}: {e}"


def run_checks(group: Any, names: Sequence[str], cfg: VerifyConfig) -> List[CheckResult]:
    """Run the named checks on this rank (collective: every rank of ``group`` calls it)."""
    g = resolve_group(group)
    by_name = {c.name: c for c in CHECKS}
    device = cfg.torch_device()
    results = []
    for name in names:
        check = by_name[name]
        cfg = replace(cfg, tol_scale=check.tol_scale)
        fwd, grad, message = _attempt(check, g, cfg)
        failed = 1.0 if message else 0.0
        fwd, grad, any_failed = _agree(g, [fwd, grad, failed], device)
        if any_failed:
            # Measure the errors without tolerances so the table shows how far off it is.
            m_fwd, m_grad, _ = _attempt(check, g, replace(cfg, rtol=math.inf, atol=math.inf))
            fwd, grad, _ = _agree(g, [m_fwd, m_grad, 0.0], device)
            if not message:
                message = "failed on another rank"
        results.append(CheckResult(name, g.size, fwd, grad, not any_failed, message))
    return results


def _worst(values: Iterable[float]) -> float:
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def merge_rank_results(per_rank: Sequence[Sequence[CheckResult]]) -> List[CheckResult]:
    """One result per check from every rank's: worst error, failed if any rank failed."""
    merged = []
    for rows in zip(*per_rank):
        first = rows[0]
        bad = [r for r in rows if not r.passed]
        message = next((r.message for r in bad if r.message and r.message != "failed on another rank"),
                       bad[0].message if bad else "")
        merged.append(CheckResult(first.name, first.tp, _worst(r.forward_error for r in rows),
                                  _worst(r.grad_error for r in rows), not bad, message))
    return merged


def _fmt_err(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2e}"


def format_table(results: Sequence[CheckResult]) -> str:
    """The verify table: check, TP size, max forward error, max gradient error, PASS/FAIL."""
    header = ("module", "TP", "max fwd err", "max grad err", "result")
    rows = [(r.name, str(r.tp), _fmt_err(r.forward_error), _fmt_err(r.grad_error), "PASS" if r.passed else "FAIL")
            for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    align = ["<", ">", ">", ">", "<"]
    line = lambda cells: "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths)).rstrip()  # noqa: E731
    out = [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]
    failures = [r for r in results if not r.passed]
    n = len(results)
    out.append("")
    out.append(f"{n - len(failures)}/{n} checks passed" if n else "no checks selected")
    for r in failures:
        out.append(f"FAIL {r.name} (TP {r.tp}): {r.message.splitlines()[0] if r.message else 'failed'}")
    return "\n".join(out)


def report_json(results: Sequence[CheckResult], dtype: str, device: str) -> Dict[str, Any]:
    """The ``--json`` report. An error that could not be measured (NaN) is ``null``: strict JSON."""
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in vars(r).items()} for r in results]
    return {"schema": "tplayers-verify/1", "dtype": dtype, "device": device, "results": rows,
            "passed": exit_code(results) == 0}


def exit_code(results: Sequence[CheckResult]) -> int:
    """0 when every check passed (and there was at least one), else 1."""
    return 0 if results and all(r.passed for r in results) else 1
