"""Cross-entropy over vocabulary-sharded logits, without ever gathering the full logits.

Each rank holds ``logits[..., start:end]`` (its `ParallelLMHead` shard). With ``z = logits - m``
where ``m`` is the row maximum over all ranks (one all-reduce of ``(tokens,)``), the loss is

    loss = log(sum_c exp(z_c)) - z_target                      (the sum: one all-reduce)

and the target logit is picked on the rank that holds it (summed in the same all-reduce). The
gradient is local: ``softmax - onehot`` on this rank's columns, so backward communicates nothing.
Communication per call: one ``(tokens,)`` max all-reduce and one ``(tokens, 2 or 3)`` sum.
"""
from __future__ import annotations

import warnings

from contextlib import nullcontext
from typing import ContextManager, Optional

import torch
from torch._C import _functions as _autograd_functions

from ..core.blocking import all_reduce_tensor
from ..core.digest import digests
from ..core.carried import Shared, carrying, kind_of
from ..core.fingerprint import checks_enabled
from ..core.invariant import check_invariant, tree_sums
from ..core.placement import padded_size
from ..core.validate import check_index_range
from ..core.groups import GroupLike, TPGroup, resolve_group

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``(N,)`` (float32 or wider) from logits shards ``(N, V'/p)`` and targets ``(N,)``."""

    @staticmethod
    def forward(ctx, logits, target, g: TPGroup, vocab_size: int, ignore_index: int, smoothing: float,
                invariant: bool):
        with _targets_carried(g, target):  # its collectives prove every rank sums over the same targets
            return _VocabParallelCrossEntropy._forward(ctx, logits, target, g, vocab_size, ignore_index, smoothing,
                                                       invariant)

    @staticmethod
    def _forward(ctx, logits, target, g: TPGroup, vocab_size: int, ignore_index: int, smoothing: float,
                 invariant: bool):
        n_local = logits.shape[-1]
        start = g.rank * n_local
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        z = logits.to(compute_dtype, copy=True)  # (N, V'/p), a buffer we own
        real = torch.arange(start, start + n_local, device=z.device) < vocab_size  # (V'/p,) not padding
        has_padding = start + n_local > vocab_size  # (known on the host: reading `real` would wait for the device)
        if has_padding:
            z.masked_fill_(~real, float("-inf"))

        m = all_reduce_tensor(z.max(dim=-1).values, group=g, op="max")  # (N,)
        z.sub_(m.unsqueeze(-1))  # numerically stable: every z <= 0

        valid = target != ignore_index  # (N,)
        in_shard = valid & (target >= start) & (target < start + n_local)
        local_t = (target - start).masked_fill(~in_shard, 0)
        z_target = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_shard, 0.0)  # (N,) on one rank
        stats = [z_target]
        if smoothing > 0:  # sum_c z_c, real classes (the tree's leaves kept: z is overwritten next)
            real_z = z.masked_fill(~real, 0.0) if has_padding else z
            stats.append(real_z.clone() if invariant else real_z.sum(-1))
        probs = z.exp_()  # (N, V'/p): exp(z), in place; padding columns are exp(-inf) = 0
        if invariant:  # (N, 2 or 3): the vocabulary's sums as the fixed tree (tplayers.core.invariant)
            sums = tree_sums(torch.stack(stats[1:] + [probs], dim=1), g, exact=z_target.unsqueeze(-1))
        else:
            stats.append(probs.sum(-1))
            sums = all_reduce_tensor(torch.stack(stats, dim=-1), group=g)  # (N, 2 or 3), one collective
        sum_exp = sums[:, -1]
        log_z = sum_exp.log()  # (N,) logsumexp - m
        loss = log_z - sums[:, 0]
        if smoothing > 0:
            loss = (1.0 - smoothing) * loss + smoothing * (log_z - sums[:, 1] / vocab_size)
        loss = loss.masked_fill(~valid, 0.0)

        probs.div_(sum_exp.unsqueeze(-1))  # softmax shard, saved for backward
        ctx.save_for_backward(probs, local_t, in_shard, valid, real if has_padding else None)
        ctx.smoothing, ctx.vocab_size, ctx.in_dtype = smoothing, vocab_size, logits.dtype
        return loss  # in the compute dtype (>= float32): the caller reduces it, then casts once

    @staticmethod
    def backward(ctx, grad_loss):
        with torch.no_grad():
            grad = _VocabParallelCrossEntropy._grad_logits(ctx, grad_loss)
        return _refuse_second_backward(grad), None, None, None, None, None, None

    @staticmethod
    def _grad_logits(ctx, grad_loss):
        probs, local_t, in_shard, valid, real = ctx.saved_tensors
        eps = ctx.smoothing
        grad = probs.clone()  # d loss / d z = softmax - (1 - eps) * onehot - eps / V
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(1.0 - eps) * in_shard.to(grad.dtype).unsqueeze(-1))
        if eps > 0:
            grad.sub_(eps / ctx.vocab_size)
            if real is not None:
                grad.masked_fill_(~real, 0.0)
        scale = grad_loss.to(grad.dtype).masked_fill(~valid, 0.0).unsqueeze(-1)  # ignored: no gradient (even 1/0)
        return (grad * scale).to(ctx.in_dtype)


def _targets_carried(g: TPGroup, target: torch.Tensor) -> ContextManager[None]:
    """The targets' digest carried by the loss's collectives: a rank given other targets (a sampler over the TP
    ranks; labels read per rank) raises :class:`~tplayers.RanksDiverged` on every rank instead of mixing the
    ranks' target logits into one wrong loss that every rank reports."""
    if g.size == 1 or not checks_enabled() or torch.compiler.is_compiling():
        return nullcontext()
    return carrying(g.process_group, _TARGETS, Shared(
        "the targets of vocab_parallel_cross_entropy", ["targets"], digests([target]),
        advice="Every TP rank must compute the loss on the same targets (a distributed sampler over the TP ranks "
               "splits them; give each TP rank of a replica the same batch).",
        kinds=lambda: [kind_of(target)]))


_TARGETS = "vocab_parallel_cross_entropy targets"


def _refuse_second_backward(grad: torch.Tensor) -> torch.Tensor:
    """``grad``, made to raise if autograd ever differentiates through it (create_graph=True).

    The saved softmax is a constant to autograd, so a second derivative through this loss would be
    wrong. ``once_differentiable`` is not enough: it marks the gradient only when the incoming
    gradient requires grad, which ``loss.backward()``'s constant 1 does not, and the second
    derivative is then silently missing its softmax term. Here the mark is unconditional."""
    if not torch.is_grad_enabled():  # plain backward: nothing will differentiate this
        return grad
    err = _autograd_functions.DelayedError(
        "vocab_parallel_cross_entropy does not support double backward (create_graph=True, e.g. a gradient "
        "penalty through the loss): its second derivative would need the softmax recomputed", 1)
    return err(grad.detach().requires_grad_())


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    *,
    group: GroupLike,
    vocab_size: Optional[int] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    tp_invariant: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy(gathered_logits, target)`` computed from this rank's logits shard.

    logits_shard: ``(..., V'/p)``, rank r's ``torch.chunk`` of the (padded) vocabulary, as
    `ParallelLMHead` produces. target: ``(...)`` integer class ids, identical on every rank.
    vocab_size: the real vocabulary; the padding columns a `ParallelLMHead` adds when it does
    not divide the TP degree never enter the loss. Pass it: the logits alone cannot say whether
    they carry padding, so without it (at p > 1) the loss assumes none (``V = p * V'/p``) and
    warns once (a FutureWarning: it becomes required in a later release).
    ``ignore_index``, ``label_smoothing`` and ``reduction`` ("mean" | "sum" | "none") follow
    ``F.cross_entropy``; "mean" averages over non-ignored targets. Targets outside
    ``[0, vocab_size)`` other than ``ignore_index`` raise IndexError, as in ``F.cross_entropy``
    (checked locally on every rank: no collective; on CUDA a device-side assert, no host sync).
    ``tp_invariant``: the sums over the vocabulary as one fixed tree over ``tplayers.core.invariant.LEAVES``
    leaves (an all-gather of ``(N, 2 or 3)`` per rank instead of the all-reduce): the loss and the logits'
    gradient are the same bits at every TP degree that divides the leaves (``parallelize(..., tp_invariant=True,
    loss_parallel=True)`` passes it); the padded vocabulary must be whole leaves.
    """
    g = resolve_group(group)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing={label_smoothing} must be in [0, 1]")
    if not logits_shard.is_floating_point():
        raise TypeError(f"vocab_parallel_cross_entropy: logits must be floating point, got {logits_shard.dtype}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"vocab_parallel_cross_entropy: target must hold integer class ids, got {target.dtype}")
    if logits_shard.dim() < 1 or tuple(logits_shard.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits shard {tuple(logits_shard.shape)} and target "
            f"{tuple(target.shape)} disagree: expected logits (*target.shape, vocab/p)")
    n_local = logits_shard.shape[-1]
    if vocab_size is None:
        vocab_size = n_local * g.size
        if g.size > 1:  # zero padding columns would enter the softmax, undetectably: say so
            warnings.warn(f"vocab_parallel_cross_entropy: no vocab_size given; assuming the {vocab_size} logit "
                          "columns carry no padding. A ParallelLMHead whose vocabulary does not divide the TP "
                          "degree pads it, and those columns would enter the loss: pass "
                          "vocab_size=head.num_embeddings (required in a later release)", FutureWarning, stacklevel=2)
    if padded_size(vocab_size, g.size) != n_local * g.size:
        raise ValueError(
            f"vocab_parallel_cross_entropy: vocab_size={vocab_size} padded to a multiple of the TP "
            f"degree {g.size} is {padded_size(vocab_size, g.size)}, but the logits shard has "
            f"{n_local} columns per rank ({n_local * g.size} in all)")
    if tp_invariant:
        check_invariant(g.size, "vocab_parallel_cross_entropy(tp_invariant=True)", n_local * g.size)
    if logits_shard.device != target.device:
        raise ValueError(f"vocab_parallel_cross_entropy: logits on {logits_shard.device}, target on {target.device}")
    # a target on a padding column (or past the vocabulary) would otherwise give a finite, wrong loss
    check_index_range(target, vocab_size, f"vocab_parallel_cross_entropy(vocab_size={vocab_size}) target",
                      ignore_index=ignore_index)

    loss = _VocabParallelCrossEntropy.apply(  # int64 ids: gather/scatter take no narrower index (uint8, int16)
        logits_shard.reshape(-1, n_local), target.reshape(-1).long(), g, vocab_size, ignore_index,
        float(label_smoothing), bool(tp_invariant))
    if reduction == "none":
        loss = loss.reshape(target.shape)
    elif reduction == "sum":
        loss = loss.sum()
    else:
        loss = loss.sum() / (target != ignore_index).sum().to(loss.dtype)
    return loss.to(logits_shard.dtype)  # low precision: rounded once, after the reduction
