"""Expert parallelism with all-to-all token dispatch: whole experts per rank, and each (token, expert)
pair sent to its expert's rank and back (Megatron-core's and transformers' ``AllToAllEP`` layout).

Rank r holds experts ``[r E/p, (r + 1) E/p)`` and its own tokens, routed where they are::

    x (t_r, h), top_k_index, top_k_weights (t_r, k)          this rank's tokens and their routes
    1. the t_r * k pairs sorted by expert (so by the rank that holds it); the count per expert
       all-gathered: every rank learns how many rows it gets from whom, for which of its experts
       (one small, checked collective: ranks out of step fail here, before any token moves)
    2. all-to-all: each pair's token row to its expert's rank             (rank r receives n_r rows)
    3. rank r's experts run on the n_r rows, each row for one expert, with weight 1
    4. all-to-all back: each row's output to the rank that sent it
    5. out[t] = sum over the k pairs of token t of weight * output         (on the token's rank)

Backward the two all-to-alls run reversed and nothing is all-reduced: every pair ran once, on one
rank, so every gradient (the experts', the tokens', the routing weights') is complete where it lands.
No pair is dropped (no capacity factor); the per-expert counts are read back to the host once per
layer (the all-to-all sizes), so this does not capture in a CUDA graph.

``sequence_parallel=False`` (tokens the same on every rank, TP without sequence parallelism): each
rank first keeps its share of the rows (:func:`~tplayers.core.rows.split_rows`, no communication;
backward all-gathers their gradients) and the outputs are all-gathered at the end, so every pair
still runs once. ``sequence_parallel=True``: the tokens are this rank's own (a sequence shard, or
any per-rank batch whose dense twin is their concatenation); nothing is split or gathered.

Versus the all-reduce dispatch (every rank runs its experts on every token, partial outputs
summed): per rank, forward, an all-reduce moves ``2 (p-1)/p t h`` elements; the all-to-alls move
``2 k t_r h (p-1)/p`` (``t_r = t / p``) plus, on replicated tokens, the gather's ``(p-1)/p t h``.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..core.blocking import all_gather_tensor
from ..core.rows import all_to_all_rows, gather_rows, split_rows
from ..core.groups import TPGroup

__all__ = ["dispatch_to_experts", "tied_to"]

ExpertsForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _TiedTo(torch.autograd.Function):
    """``out`` unchanged, recorded as depending on ``inputs`` (zero gradient): backward reaches the
    inputs' collective on every rank, whether or not this rank's experts used them."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in inputs]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes))


def tied_to(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``out`` unchanged, recorded as depending on ``inputs`` with a zero gradient: backward reaches the
    inputs' collectives on every rank, also where this rank's experts used none of them (an expert that got
    no token returns zeros autograd cannot trace back)."""
    return _TiedTo.apply(out, *inputs)


def dispatch_to_experts(run_experts: ExpertsForward, x: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, *, group: TPGroup, num_experts: int,
                        sequence_parallel: bool) -> torch.Tensor:
    """``sum_k top_k_weights[t, k] * expert[top_k_index[t, k]](x[t])`` for every token ``t`` of ``x``
    ``(t, h)``, the experts spread whole over ``group`` (``num_experts / p`` per rank, in rank order) and
    run by ``run_experts(rows (n, h), local_ids (n, 1), weights (n, 1))`` on this rank's; see the module
    docstring. ``top_k_index`` holds global expert ids in ``[0, num_experts)``. ``run_experts`` returns an
    output recorded as depending on the experts' trained parameters also when it got no row (ParallelExperts
    ties it to them), so the exchange back runs backward on every rank, also where the tokens take no gradient."""
    g = group
    if num_experts % g.size:
        raise ValueError(f"all-to-all dispatch: {num_experts} experts do not divide over {g.size} ranks")
    local = num_experts // g.size
    tokens = x.shape[0]
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != tokens:
        raise ValueError(f"all-to-all dispatch: top_k_index {tuple(top_k_index.shape)} and top_k_weights "
                         f"{tuple(top_k_weights.shape)} must both be (tokens={tokens}, k)")
    if not sequence_parallel:  # the same tokens on every rank: each keeps its share of the rows
        x, top_k_weights = split_rows(x, group=g), split_rows(top_k_weights, group=g)
        top_k_index = top_k_index.tensor_split(g.size, dim=0)[g.rank]
    k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1).long()  # (t_r * k,): the pairs, token-major
    order = torch.argsort(ids, stable=True)  # pairs by expert, so by the rank holding it
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    table = all_gather_tensor(counts.view(1, num_experts), 0, group=g)  # (p, E): sender s's pairs per expert
    mine = table[:, g.rank * local:(g.rank + 1) * local]  # (p, E/p): rows for each of my experts, by sender
    send_rows = counts.view(g.size, local).sum(dim=1).tolist()
    recv_rows = mine.sum(dim=1).tolist()
    rows = all_to_all_rows(x[order // k], send_rows, recv_rows, group=g)  # (n_r, h)
    # from each sender, its rows come sorted by expert: this rank's experts 0, 1, ... in turn
    expert = torch.arange(local, device=ids.device).repeat(g.size).repeat_interleave(mine.reshape(-1))
    out = run_experts(rows, expert.view(-1, 1), rows.new_ones((rows.shape[0], 1)))  # (n_r, h)
    if torch.is_grad_enabled() and rows.requires_grad:
        out = tied_to(out, rows)  # an expert that got no row still takes part in backward's exchange
    back = all_to_all_rows(out, recv_rows, send_rows, group=g)  # (t_r * k, h), in `order`
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=order.device)
    pairs = back[unsort].view(top_k_index.shape[0], k, back.shape[-1])  # (t_r, k, h)
    y = (pairs * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(dim=1)  # (t_r, h)
    return y if sequence_parallel else gather_rows(y, tokens, group=g)
