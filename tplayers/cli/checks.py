"""The ``tplayers verify`` checks: every TP module against its dense reference built from the same
seeded full weights, through :func:`tplayers.testing.assert_matches_dense` (outputs, input gradients,
gathered parameter gradients).

Shapes scale with the TP degree p (hidden 16p, ffn 32p, seq 4p, 2p heads of 8, vocab 8p or
8p+3 for the padded embedding) so every check fits every p. A new TP module adds its check here.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..convert.parallelize import parallelize
from ..convert.styles import Column, Row
from ..core.groups import TPGroup
from ..core.invariant import LEAVES
from ..core.dtypes import DTYPES
from ..core.placement import Sharded
from ..layers import (ColumnParallelEmbedding, ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding, set_overlap,
                      declare_siblings, use_main_grad)
from ..models.blocks import ParallelAttention, ParallelMLP, ParallelTransformerBlock
from ..models.moe import DenseMoE, ParallelMoE
from ..models.dense import BlockConfig, DenseAttention, DenseGPT, DenseMLP, DenseTransformerBlock, GPTConfig
from ..models.gpt import ParallelGPT
from ..models.loss import vocab_parallel_cross_entropy
from ..testing import MatchReport, assert_matches_dense
from .registry import VerifyConfig, register, tolerance, variant

# ---------------------------------------------------------------------------- shapes and helpers


def _dims(g: TPGroup) -> Dict[str, int]:
    p = g.size
    return dict(seq=4 * p, hidden=16 * p, ffn=32 * p)


def _input(cfg: VerifyConfig, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64).to(cfg.torch_device(), cfg.torch_dtype)


def _dense(module: nn.Module, cfg: VerifyConfig) -> nn.Module:
    return module.to(cfg.torch_device(), cfg.torch_dtype)


def match_dense(tp: nn.Module, dense: nn.Module, x: Any, g: TPGroup, cfg: VerifyConfig, **kw: Any) -> MatchReport:
    """``assert_matches_dense`` with the check's tolerances (`tolerance`) and seed."""
    rtol, atol = tolerance(cfg)
    return assert_matches_dense(tp, dense, x, group=g, rtol=rtol, atol=atol, seed=cfg.seed, **kw)


def _seq_shards(sp: bool) -> Dict[str, Any]:
    """assert_matches_dense's shard dims for a module whose input and output are (b, s | s/p, h)."""
    return dict(input_shard_dims=[-2] if sp else None, output_shard_dim=-2 if sp else None)


# ---------------------------------------------------------------------------- the checks: linears


def _column(g: TPGroup, cfg: VerifyConfig, **options: Any) -> MatchReport:
    d = _dims(g)
    dense = _dense(nn.Linear(d["hidden"], d["ffn"]), cfg)
    tp = ColumnParallelLinear.from_dense(dense, group=g, **options)
    return match_dense(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                       input_shard_dims=[-2] if options.get("sequence_parallel") else None,
                       output_shard_dim=None if options.get("gather_output") else -1)


def _row(g: TPGroup, cfg: VerifyConfig, **options: Any) -> MatchReport:
    d = _dims(g)
    dense = _dense(nn.Linear(d["ffn"], d["hidden"]), cfg)
    tp = RowParallelLinear.from_dense(dense, group=g, **options)
    return match_dense(tp, dense, _input(cfg, cfg.batch, d["seq"], d["ffn"]), g, cfg,
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
    return match_dense(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                       **_seq_shards(options.get("sequence_parallel", False)))


def _uneven_mlp(g: TPGroup, cfg: VerifyConfig, **options: Any) -> MatchReport:
    """An ffn that does not divide p (32p + 3): split as evenly as possible (``split=``), each rank padded to the
    largest piece; sigmoid(0) = 1/2 on the padding features, which the row layer must mask."""
    d = _dims(g)
    ffn = d["ffn"] + 3
    dense = _dense(nn.Sequential(nn.Linear(d["hidden"], ffn), nn.Sigmoid(), nn.Linear(ffn, d["hidden"])), cfg)
    split = Sharded.balanced(0, ffn, g.size).parts[0]
    tp = nn.Sequential(ColumnParallelLinear.from_dense(dense[0], group=g, split=split, **options), nn.Sigmoid(),
                       RowParallelLinear.from_dense(dense[2], group=g, split=split, **options))
    return match_dense(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                       **_seq_shards(options.get("sequence_parallel", False)))


def _invariant_mlp(g: TPGroup, cfg: VerifyConfig, sequence_parallel: bool) -> MatchReport:
    """``parallelize(..., tp_invariant=True)`` of a dense MLP: within tolerance of the dense MLP, and exactly TP 1's
    bits (the same parallelize at TP 1, run on every rank): output, input and every parameter gradient. At a TP
    degree that does not divide the leaves, the refusal is what passes."""
    d = _dims(g)

    def build() -> nn.Module:
        torch.manual_seed(cfg.seed)
        return _dense(nn.Sequential(nn.Linear(d["hidden"], d["ffn"]), nn.GELU(), nn.Linear(d["ffn"], d["hidden"])), cfg)
    plan = {"0": Column(sequence_parallel=sequence_parallel), "2": Row(sequence_parallel=sequence_parallel)}
    if LEAVES % g.size:
        try:
            parallelize(build(), plan, group=g, tp_invariant=True, audit=False)
        except ValueError as e:
            if "does not divide them" in str(e):
                return MatchReport()
            raise
        raise AssertionError(f"tp_invariant=True at TP {g.size} (not a divisor of {LEAVES} leaves) was not refused")
    x, shards = _input(cfg, cfg.batch, d["seq"], d["hidden"]), _seq_shards(sequence_parallel)
    tp = parallelize(build(), plan, group=g, tp_invariant=True, audit=False)
    report = match_dense(tp, build(), x, g, cfg, **shards)
    tp1 = parallelize(build(), plan, group=None, tp_invariant=True, audit=False, check_consistency=False)
    assert_matches_dense(tp, tp1, x, group=g, rtol=0.0, atol=0.0, seed=cfg.seed, **shards)  # the same bits
    return report


class _OneInput(nn.ModuleDict):
    """``o(q(x) * k(x) + v(x))``: three column layers read one input (an attention's q / k / v), a row layer after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self["o"](self["q"](x) * self["k"](x) + self["v"](x))


def _siblings(g: TPGroup, cfg: VerifyConfig, wide: bool = False, **options: Any) -> MatchReport:
    """q / k / v declared siblings (`declare_siblings`, as parallelize declares them and gate / up): one collective
    for their summed input gradient; under SP, narrower together than twice the input, their backward rank-major
    (``wide``: each as wide as the input per rank, the set's backward in the sequence's order)."""
    d = _dims(g)
    h, f = d["hidden"], d["hidden"] * (g.size if wide else 1) // (1 if wide else 2)
    dense = _dense(_OneInput({**{n: nn.Linear(h, f) for n in "qkv"}, "o": nn.Linear(f, h)}), cfg)
    sp = options.get("sequence_parallel", False)
    cols = {n: ColumnParallelLinear.from_dense(dense[n], group=g, **options) for n in "qkv"}
    tp = _OneInput({**cols, "o": RowParallelLinear.from_dense(dense["o"], group=g, sequence_parallel=sp)})
    declare_siblings(*cols.values())
    return match_dense(tp, dense, _input(cfg, cfg.batch, d["seq"], h), g, cfg, **_seq_shards(sp))


variant("ColumnParallelLinear", "gather_output=False", _column)
variant("ColumnParallelLinear", "gather_output=True", _column, gather_output=True)
variant("ColumnParallelLinear", "overlap_comm=False", _column, overlap_comm=False)
variant("ColumnParallelLinear", "sequence_parallel=True", _column, sequence_parallel=True)
variant("RowParallelLinear", "input_is_parallel=True", _row)
variant("RowParallelLinear", "input_is_parallel=False", _row, input_is_parallel=False)
variant("RowParallelLinear", "sequence_parallel=True", _row, sequence_parallel=True)
variant("Column->Row", "sequence_parallel=True", _mlp_pair, tol_scale=2, act=False, sequence_parallel=True)
variant("declared siblings", "q/k/v on one input", _siblings, tol_scale=2)
variant("declared siblings", "q/k/v, sequence_parallel=True", _siblings, tol_scale=2, sequence_parallel=True)
variant("declared siblings", "q/k/v wide, sequence_parallel=True, delay_wgrad=True",
        _siblings, tol_scale=2, wide=True, sequence_parallel=True, delay_wgrad=True)
variant("Column->GELU->Row MLP", "", _mlp_pair, tol_scale=2, act=True)
variant("Column->GELU->Row MLP", "overlap_comm=False", _mlp_pair, tol_scale=2, act=True, overlap_comm=False)
variant("Column->GELU->Row MLP", "sequence_parallel=True", _mlp_pair, tol_scale=2, act=True, sequence_parallel=True)
variant("Column->Sigmoid->Row MLP", "ffn 32p+3, uneven split", _uneven_mlp, tol_scale=2)
variant("Column->GELU->Row MLP", "tp_invariant=True: TP 1's bits", _invariant_mlp, tol_scale=2, sequence_parallel=False)
variant("Column->GELU->Row MLP", "tp_invariant=True, sequence_parallel=True: TP 1's bits", _invariant_mlp, tol_scale=2,
        sequence_parallel=True)


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

    def __init__(self, target: torch.Tensor, g: TPGroup, vocab_size: int, **options: Any) -> None:
        super().__init__()
        self.target, self.g, self.vocab_size, self.options = target, g, vocab_size, options

    def forward(self, logits_shard: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_shard, self.target, group=self.g, vocab_size=self.vocab_size,
                                            **self.options)


def _cross_entropy(g: TPGroup, cfg: VerifyConfig, **options: Any) -> MatchReport:
    d = _dims(g)
    vocab = 8 * g.size
    logits = _input(cfg, cfg.batch, d["seq"], vocab) * 3  # (b, s, V)
    target = torch.randint(0, vocab, (cfg.batch, d["seq"]), device=cfg.torch_device())  # (b, s)
    if "ignore_index" in options:
        target[0, 0] = options["ignore_index"]
    return match_dense(_VocabParallelCrossEntropy(target, g, vocab, **options), _CrossEntropy(target, **options),
                       logits, g, cfg, input_shard_dims=[-1])


variant("vocab_parallel_cross_entropy", "reduction='none'", _cross_entropy, reduction="none")
variant("vocab_parallel_cross_entropy", "mean, label_smoothing=0.1, ignore_index", _cross_entropy,
         reduction="mean", label_smoothing=0.1, ignore_index=-100)


def _embedding(g: TPGroup, cfg: VerifyConfig, **options: Any) -> MatchReport:
    d = _dims(g)
    vocab = 8 * g.size + 3  # not divisible by p > 1: exercises the padded last shard
    dense = _dense(nn.Embedding(vocab, d["hidden"]), cfg)
    tp = VocabParallelEmbedding.from_dense(dense, group=g, **options)
    ids = torch.randint(0, vocab, (cfg.batch, d["seq"]), device=cfg.torch_device())  # (b, s)
    sp = options.get("sequence_parallel", False)
    return match_dense(tp, dense, ids, g, cfg, output_shard_dim=-2 if sp else None)


variant("VocabParallelEmbedding", "vocab=8p+3", _embedding)
variant("VocabParallelEmbedding", "vocab=8p+3, sequence_parallel=True", _embedding, sequence_parallel=True)


@register("ColumnParallelEmbedding", "embedding dim split (value embeddings by KV heads)")
def check_column_embedding(g: TPGroup, cfg: VerifyConfig) -> MatchReport:
    d = _dims(g)
    dense = _dense(nn.Embedding(8 * g.size + 3, d["hidden"]), cfg)
    tp = ColumnParallelEmbedding.from_dense(dense, group=g)
    ids = torch.randint(0, dense.num_embeddings, (cfg.batch, d["seq"]), device=cfg.torch_device())  # (b, s)
    return match_dense(tp, dense, ids, g, cfg, output_shard_dim=-1)


def _lm_head(g: TPGroup, cfg: VerifyConfig, padded: bool, sp: bool, **options: Any) -> MatchReport:
    d = _dims(g)
    vocab = 8 * g.size + (3 if padded else 0)  # without padding the gathered shards are the dense logits
    dense = _dense(nn.Linear(d["hidden"], vocab, bias=False), cfg)
    tp = ParallelLMHead.from_dense(dense, group=g, sequence_parallel=sp, **options)
    gathered = options.get("gather_output", False)
    return match_dense(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                       input_shard_dims=[-2] if sp else None, output_shard_dim=None if gathered else -1)


variant("ParallelLMHead", "vocab=8p+3, gather_output=True", _lm_head, padded=True, sp=False, gather_output=True)
variant("ParallelLMHead", "vocab=8p, logits shard, sequence_parallel=True", _lm_head, padded=False, sp=True)


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
    return match_dense(tp, dense, ids, g, cfg)


def _parallel_mlp(g: TPGroup, cfg: VerifyConfig, activation: str, sp: bool, split: bool = False) -> MatchReport:
    d = _dims(g)
    dense = _dense(DenseMLP(d["hidden"], d["ffn"], activation), cfg)
    tp = ParallelMLP.from_dense(dense, group=g, sequence_parallel=sp, split_backward=split)
    return match_dense(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                       **_seq_shards(sp))


variant("ParallelMLP", "gelu", _parallel_mlp, tol_scale=2, activation="gelu", sp=False)
variant("ParallelMLP", "swiglu", _parallel_mlp, tol_scale=2, activation="swiglu", sp=False)
variant("ParallelMLP", "swiglu, sequence_parallel=True", _parallel_mlp, tol_scale=2, activation="swiglu", sp=True)
variant("ParallelMLP", "gelu, split_backward=True", _parallel_mlp, tol_scale=2, activation="gelu", sp=False, split=True)


def _parallel_moe(g: TPGroup, cfg: VerifyConfig, experts: str, extra_ffn: int = 0, sp: bool = False) -> MatchReport:
    d = _dims(g)
    dense = _dense(DenseMoE(d["hidden"], d["ffn"] + extra_ffn, num_experts=2 * g.size, top_k=2), cfg)
    tp = ParallelMoE.from_dense(dense, group=g, experts=experts, sequence_parallel=sp)
    return match_dense(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg, **_seq_shards(sp))


variant("ParallelMoE", "top-2 of 2p experts, each expert's ffn split", _parallel_moe, tol_scale=2, experts="ffn")
variant("ParallelMoE", "top-2 of 2p experts, whole experts per rank", _parallel_moe, tol_scale=2, experts="whole")
variant("ParallelMoE", "each expert's ffn 32p+3, uneven split", _parallel_moe, tol_scale=2, experts="ffn", extra_ffn=3)
variant("ParallelMoE", "whole experts, tokens sent by all-to-all, sequence_parallel=True", _parallel_moe, tol_scale=2,
        experts="all_to_all", sp=True)


def _heads(g: TPGroup) -> Dict[str, int]:
    # 2 query heads per rank, head_dim 8; GQA: half as many KV heads as ranks (replicated KV heads)
    return dict(n_heads=2 * g.size, n_kv_heads=max(1, g.size // 2))


def _attention(g: TPGroup, cfg: VerifyConfig, gqa: bool, sp: bool, rotary: bool) -> MatchReport:
    d, h = _dims(g), _heads(g)
    dense = _dense(DenseAttention(d["hidden"], h["n_heads"], h["n_kv_heads"] if gqa else None,
                                  causal=True, rotary=rotary), cfg)
    tp = ParallelAttention.from_dense(dense, group=g, sequence_parallel=sp)
    return match_dense(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                       **_seq_shards(sp))


variant("ParallelAttention", "MHA, causal", _attention, tol_scale=8, gqa=False, sp=False, rotary=False)
variant("ParallelAttention", "GQA (kv heads = p/2), causal, rotary", _attention, tol_scale=8,
         gqa=True, sp=False, rotary=True)
variant("ParallelAttention", "GQA, rotary, sequence_parallel=True", _attention, tol_scale=8,
         gqa=True, sp=True, rotary=True)


def _block(g: TPGroup, cfg: VerifyConfig, sp: bool, llama: bool, split: bool = False, chunks: int = 1,
           delay: bool = False, main_grad: bool = False, cm: bool = False) -> MatchReport:
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
    set_overlap(tp, split_backward=split, chunks=chunks, delay_wgrad=delay,  # (verify flushes delayed wgrads)
                collective_matmul=cm)
    if main_grad:  # buffers of the check's dtype: compared as the gradients
        use_main_grad(tp, dtype=DTYPES[cfg.dtype])
    return match_dense(tp, dense, _input(cfg, cfg.batch, d["seq"], d["hidden"]), g, cfg,
                       **_seq_shards(sp))


variant("ParallelTransformerBlock", "GPT: gelu, layernorm, MHA", _block, tol_scale=16, sp=False, llama=False)
variant("ParallelTransformerBlock", "GPT, sequence_parallel=True", _block, tol_scale=16, sp=True, llama=False)
variant("ParallelTransformerBlock", "Llama: swiglu, rmsnorm, GQA, rotary", _block, tol_scale=16, sp=False, llama=True)
variant("ParallelTransformerBlock", "Llama, sequence_parallel=True", _block, tol_scale=16, sp=True, llama=True)
variant("ParallelTransformerBlock", "Llama, sequence_parallel=True, split_backward=True", _block, tol_scale=16, sp=True,
        llama=True, split=True)
variant("ParallelTransformerBlock", "Llama, split_backward=True, chunks=2 (interleaved)", _block, tol_scale=16,
        sp=False, llama=True, split=True, chunks=2)
variant("ParallelTransformerBlock", "GPT, chunks=2 (interleaved), main_grad", _block, tol_scale=16, sp=False,
        llama=False, chunks=2, main_grad=True)
variant("ParallelTransformerBlock", "Llama, sequence_parallel=True, delay_wgrad=True", _block, tol_scale=16, sp=True,
        llama=True, delay=True)
variant("ParallelTransformerBlock", "GPT, split_backward=True, main_grad", _block, tol_scale=16, sp=False,
        llama=False, split=True, main_grad=True)
# GQA with fewer KV heads than ranks (at TP 2 and 4): the KV rows of qkv are replicated pieces whose
# main_grad contributions must be summed over their replica ranks
variant("ParallelTransformerBlock", "Llama, sequence_parallel=True, split_backward=True, main_grad", _block,
        tol_scale=16, sp=True, llama=True, split=True, main_grad=True)
variant("ParallelTransformerBlock", "Llama, sequence_parallel=True, collective_matmul=True", _block, tol_scale=16,
        sp=True, llama=True, cm=True)


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
        return match_dense(_Call(tp, "logits"), _Call(dense, "forward"), ids, g, cfg)
    targets = torch.randint(0, vocab, (cfg.batch, d["seq"]), device=ids.device)  # (b, s)
    targets[0, 0] = -100  # ignored
    return match_dense(_Call(tp, "loss", targets), _Call(dense, "loss", targets), ids, g, cfg)


variant("ParallelGPT", "logits, GQA, rotary, vocab=8p+3", _gpt, tol_scale=32, what="logits", sp=False)
variant("ParallelGPT", "loss (vocab-parallel cross-entropy)", _gpt, tol_scale=32, what="loss", sp=False)
variant("ParallelGPT", "loss, sequence_parallel=True", _gpt, tol_scale=32, what="loss", sp=True)
