"""The same bits at every TP degree: the column and row linears with every sum TP splits computed as one fixed
tree over ``LEAVES`` leaves (``parallelize(..., tp_invariant=True)``).

TP splits two sums of the Column -> Row path: the row layer's contraction over its input features (forward) and
the column layer's input gradient, a contraction over its output features (backward). Summed as TP usually sums
them (each rank's partial GEMM, then an all-reduce in the ring's order) their bits depend on the TP degree. Here
the contraction is cut into ``LEAVES`` consecutive leaves, whatever the degree; each of p ranks holds
``LEAVES / p`` consecutive ones::

    TP 1:  leaf 0 .. leaf 7 -> ((0+1)+(2+3)) + ((4+5)+(6+7))
    TP 2:  rank 0: (0+1)+(2+3)   rank 1: (4+5)+(6+7)   -> all-gather -> s0 + s1
    TP 4:  rank r: leaves 2r, 2r+1 summed             -> all-to-all of quarters -> (s0+s1) + (s2+s3) on each
                                                          quarter -> all-gather of the quarters

Every leaf is one batch of one bmm, the same shape at every degree. The GEMMs whose split dimension changes
with the degree (the column layer's forward and weight gradient, the row layer's input and weight gradients) are
computed in ``LEAVES`` blocks of fixed width the same way: on this build a GEMM's output columns are not the
same bits when it computes 8 of them as when it computes 32 (benchmarks/tp_invariance_probe.py). Bias gradients
are summed feature by feature (a column sum over fewer features is not the same either). The cross-rank step is
an all-gather of each rank's subtree sum and the tree's top computed on every rank at TP 2 (a ring all-reduce's
bytes); above, an all-to-all of 1/p chunks of the subtree sums, the tree on each, and an all-gather of the summed
chunks (a ring all-reduce's bytes again; benchmarks/RESULTS.md); under sequence parallelism, where each rank keeps
its chunk of the sequence, an all-to-all of the subtree sums' chunks and the tree over the p received (the bytes of
the reduce-scatter it replaces). No overlap: the collective waits where it is issued.

Two more kinds of split sum use the same leaves: a replicated module's parameter gradient when each rank runs it on
its part of a split input (`leaf_copies`: one copy of the parameters per leaf of the input, the leaves' gradients
summed as the tree; `tplayers.convert.invariant.run_in_leaves` runs the module leaf by leaf), and the
vocabulary-parallel loss's sums over the vocabulary (`tree_sums`).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from .collectives import SEQ_DIM, all_gather, all_to_all
from .functional import autocast_dtype
from .groups import TPGroup
from .siblings import Siblings, joins_siblings

__all__ = ["LEAVES", "check_invariant", "invariant_column_linear", "invariant_row_linear", "leaf_copies",
           "tree_sums"]

LEAVES = 8  # the contraction's leaves: TP degrees 1, 2, 4, 8 are invariant


def check_invariant(size: int, layer: str, features: Optional[int] = None) -> None:
    """The TP degree divides ``LEAVES`` and the split ``features`` (when given) are whole leaves on every rank;
    a ValueError starting with ``layer`` otherwise."""
    if LEAVES % size:
        raise ValueError(f"{layer}: tp_invariant=True sums over {LEAVES} leaves; the TP degree {size} does not "
                         f"divide them (TP 1, 2, 4, 8 are invariant)")
    if features is not None and features % LEAVES:
        raise ValueError(f"{layer}: its split features ({features}) are not {LEAVES} whole leaves")


def _tree(parts: torch.Tensor) -> torch.Tensor:
    """``parts`` (n, ...) summed as a binary tree of adjacent pairs (n a power of two)."""
    while parts.shape[0] > 1:
        parts = parts[0::2] + parts[1::2]
    return parts[0]


def _across(local: torch.Tensor, g: TPGroup, sequence_parallel: bool = False,
            how: Optional[str] = None) -> torch.Tensor:
    """The tree's top over the group, from this rank's subtree sum ``local`` (..., s, n): the same on every rank, or
    with ``sequence_parallel`` only this rank's chunk of the sequence (dim -2) of it: an all-to-all of the chunks and
    the tree over the p received, the bytes of a reduce-scatter. Whole, ``how``: ``"all_gather"`` (every rank's
    subtree sum gathered, p - 1 times the tensor received per rank) or ``"all_to_all"`` (the tree on this rank's
    1/p of the elements, then an all-gather of the sums: a ring all-reduce's bytes, two collectives); the same bits.
    Default: the all-gather at TP 2 (the same bytes, one collective), the all-to-all above (half the bytes at TP 4;
    0.50x the time on the emulated H100 link, 0.38x on gloo at 16 MB: benchmarks/tp_invariant_cross_rank.py)."""
    if g.size == 1:
        return local
    how = how or ("all_gather" if g.size == 2 else "all_to_all")
    if sequence_parallel:
        return _tree_of_mine(torch.stack(local.chunk(g.size, dim=SEQ_DIM)), g)  # (..., s/p, n)
    if how == "all_gather":
        return _tree(all_gather(local.unsqueeze(0), 0, g).wait())  # every rank's subtree, in rank order
    flat = local.reshape(-1)
    pad = -flat.numel() % g.size
    mine = _tree_of_mine(torch.cat([flat, flat.new_zeros(pad)]).view(g.size, -1), g)  # (n/p,)
    return all_gather(mine, 0, g).wait()[:flat.numel()].view_as(local)


def _tree_of_mine(chunks: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """``chunks`` (p, ...): chunk j of this rank's subtree sum for rank j; every rank's chunk of this rank's, summed
    as the tree over the ranks (an all-to-all: the bytes of a reduce-scatter)."""
    return _tree(all_to_all(chunks, [1] * g.size, [1] * g.size, g).wait())


def _contract(a: torch.Tensor, b: torch.Tensor, g: TPGroup, sequence_parallel: bool = False,
              parts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``a @ b.T`` summed over the group, where ``a`` (..., k) and ``b`` (n, k) hold this rank's consecutive k of
    the contraction (``parts``: the widths of its consecutive parts, default one): this rank's ``LEAVES / p``
    leaves as one batched GEMM (`_leaf_products`), their subtree, the tree's top (`_across`: whole, or this rank's
    chunk of the sequence)."""
    products = _leaf_products(a, b, g, parts)
    return _across(_tree(products).view(*a.shape[:-1], b.shape[0]), g, sequence_parallel)


def _leaf_products(a: torch.Tensor, b: torch.Tensor, g: TPGroup, parts: Optional[Sequence[int]] = None
                   ) -> torch.Tensor:
    """:func:`_contract`'s leaves: (leaves, m, n), leaf j ``a``'s j-th block of k times ``b``'s (m: ``a``'s rows)."""
    parts = parts or (a.shape[-1],)
    leaves = LEAVES // g.size
    a_leaves = _leaf_major(a.reshape(-1, a.shape[-1]), leaves, parts)  # (leaves, m, k/leaves)
    b_leaves = _leaf_major(b, leaves, parts)  # (leaves, n, k/leaves)
    return _per_block(a_leaves, b_leaves.transpose(1, 2))  # (leaves, m, n)


def _per_block(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` as one GEMM call per block: a batched GEMM's kernel is chosen by its batch count too
    (this CPU build's bfloat16 bmm takes oneDNN above batch x m x k x n = 16^3: a decoding step's 8 blocks at TP 1,
    not its 2 at TP 4; cuBLAS picks by batch count as well), so the blocks, the same shape at every TP degree, are
    each computed alone: the same kernel, the same bits, whatever the degree. ``out=`` rows of one buffer (autocast
    casts a bmm's operands but leaves an ``out=`` GEMM alone: its cast is made here)."""
    dtype = autocast_dtype(a)
    if dtype is not None and a.is_floating_point():
        a, b = a.to(dtype), b.to(dtype)
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
    for j in range(a.shape[0]):
        torch.mm(a[j], b[j], out=out[j])
    return out


def _leaf_major(t: torch.Tensor, leaves: int, parts: Sequence[int]) -> torch.Tensor:
    """``t`` (m, k) as (leaves, m, k/leaves): leaf j holds the j-th of ``leaves`` consecutive blocks of each of k's
    consecutive ``parts`` (their widths; a fused q/k/v's leaf is its q, k and v blocks), the same features at
    every TP degree."""
    pieces = t.split(list(parts), dim=1)
    return torch.cat([piece.reshape(t.shape[0], leaves, -1) for piece in pieces], dim=2).transpose(0, 1).contiguous()


def _in_blocks(a: torch.Tensor, b: torch.Tensor, blocks: int, split_rows: bool) -> torch.Tensor:
    """``a @ b`` (2-D) with the dimension TP splits (``a``'s rows if ``split_rows``, else ``b``'s columns) cut
    into ``blocks`` of a fixed width, each one batch of one bmm: a GEMM's bits can depend on how many rows or
    columns it computes at once (8 columns of 32 differ from the same 8 alone on this build), so every block is
    the same GEMM at every TP degree."""
    if split_rows:
        out = _per_block(a.reshape(blocks, a.shape[0] // blocks, a.shape[1]), b.expand(blocks, *b.shape))
        return out.reshape(a.shape[0], b.shape[1])  # (n, m)
    b_blocks = b.reshape(b.shape[0], blocks, b.shape[1] // blocks).transpose(0, 1).contiguous()  # (blocks, k, m/blocks)
    out = _per_block(a.expand(blocks, *a.shape), b_blocks)  # (blocks, n, m/blocks)
    return out.transpose(0, 1).reshape(a.shape[0], b.shape[1])


def _bias_grad(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (tokens, n) summed over the tokens, each feature's sum on its own contiguous row: a column sum
    (``sum(0)``) of fewer features can take other bits (37 x 96 in float32 on this build)."""
    return flat.t().contiguous().sum(1)


def _whole_sequence(x: torch.Tensor, g: TPGroup, sequence_parallel: bool) -> torch.Tensor:
    """``x`` (..., s/p, n) all-gathered along the sequence with ``sequence_parallel``; else ``x``."""
    return all_gather(x, SEQ_DIM, g).wait() if sequence_parallel and g.size > 1 else x


class _InvariantEntry(torch.autograd.Function):
    """A call's entry under ``tp_invariant`` (:mod:`.siblings`): forward hands the members x (SP: gathered once) and
    a stand-in for x's leaves (one element, expanded: (leaves, m, in)); each member returns its leaf products as
    that stand-in's gradient, so autograd adds them leaf by leaf in the members' backward order and runs this
    backward after them: the fixed tree over the leaves, then one cross-rank step for the set."""

    @staticmethod
    def forward(ctx, call, x):
        ctx.call = call
        ctx.set_materialize_grads(False)
        token = call.gather(x) if call.sp else x.view_as(x)  # (..., s, in)
        ctx.shape = token.shape
        dtype = autocast_dtype(x) or x.dtype  # the members' products' (autograd casts a gradient to its input's)
        leaves = x.new_zeros((), dtype=dtype).expand(LEAVES // call.g.size, token.numel() // token.shape[-1],
                                                     token.shape[-1])
        return token, leaves

    @staticmethod
    def backward(ctx, grad_token, grad_leaves):
        call = ctx.call
        call.take_left()  # (the gather of x the members shared)
        if grad_leaves is None:
            return None, None
        return None, _across(_tree(grad_leaves).view(ctx.shape), call.g, call.sp)


class _InvariantColumnFn(torch.autograd.Function):
    """``x @ W_r^T + b_r`` in fixed blocks of output features (of each of the fused ``parts``); backward's input
    gradient summed as the fixed tree over the output features. ``sequence_parallel``: ``x`` is this rank's chunk
    of the sequence, all-gathered (again in backward: only the chunk is kept), the input gradient this rank's chunk
    of the tree's top. A member of a call (``call``): ``x`` is its entry's (gathered) input, ``leaves`` the entry's
    stand-in, whose gradient is the member's leaf products (the entry sums the set's); ``kept``: what the weight
    gradient multiplies (SP: the shard, gathered again once for the set)."""

    @staticmethod
    def forward(ctx, x, weight, bias, g: TPGroup, sequence_parallel: bool, parts: Tuple[int, ...],
                call: Any = None, leaves_in: Optional[torch.Tensor] = None, kept: Optional[torch.Tensor] = None):
        ctx.save_for_backward(x if call is None else kept, weight)
        ctx.g, ctx.sp, ctx.parts, ctx.has_bias, ctx.call = g, sequence_parallel, parts, bias is not None, call
        if call is None:
            x = _whole_sequence(x, g, sequence_parallel)
        rows, leaves = x.reshape(-1, x.shape[-1]).contiguous(), LEAVES // g.size
        out = torch.cat([_in_blocks(rows, w.t(), leaves, split_rows=False) for w in weight.split(parts)], dim=1)
        out = out.view(*x.shape[:-1], weight.shape[0])  # (..., s, out/p)
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad_out):  # (..., s, out/p)
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        leaves = LEAVES // ctx.g.size
        call = ctx.call
        if ctx.sp and call is not None and need_w:  # the call's one gather of x, for every member
            x = call.gathered_input(x, overlap=False).wait()
        else:
            x = _whole_sequence(x, ctx.g, ctx.sp and need_w)
        grad_x = grad_leaves = None  # (..., s[/p], in); a member: (leaves, m, in) for its entry to sum
        if call is not None:
            call.began()
            grad_leaves = _leaf_products(grad_out, weight.t(), ctx.g, ctx.parts) if ctx.needs_input_grad[7] else None
        elif need_x:
            grad_x = _contract(grad_out, weight.t(), ctx.g, ctx.sp, ctx.parts)
        flat = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = None
        if need_w:  # (out/p, in)
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            grad_w = torch.cat([_in_blocks(f.t().contiguous(), rows, leaves, split_rows=True)
                                for f in flat.split(ctx.parts, dim=1)], dim=0)
        grad_b = _bias_grad(flat) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None, None, grad_leaves, None


class _InvariantRowFn(torch.autograd.Function):
    """``sum_r x_r @ W_r^T + b`` as the fixed tree over the input features; backward needs no collective, its
    GEMMs in fixed blocks of the input features. ``sequence_parallel``: the output is this rank's chunk of the
    sequence; backward all-gathers its gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, g: TPGroup, sequence_parallel: bool):
        ctx.save_for_backward(x, weight)
        ctx.g, ctx.sp, ctx.has_bias = g, sequence_parallel, bias is not None
        out = _contract(x, weight, g, sequence_parallel)  # (..., s[/p], out), the same on every rank
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad_out):  # (..., s[/p], out)
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        leaves = LEAVES // ctx.g.size
        grad_out = _whole_sequence(grad_out, ctx.g, ctx.sp)  # (..., s, out)
        flat = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        grad_x = None
        if need_x:  # (..., s, in/p): this rank's columns of the dense product
            grad_x = _in_blocks(flat, weight, leaves, split_rows=False).view(*x.shape[:-1], weight.shape[1])
        rows = x.reshape(-1, x.shape[-1])
        grad_w = _in_blocks(flat.t().contiguous(), rows, leaves, split_rows=False) if need_w else None  # (out, in/p)
        grad_b = _bias_grad(flat) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


class _LeafCopies(torch.autograd.Function):
    """``leaves`` copies of the parameters, one per leaf of a split input a module runs on leaf by leaf; backward
    sums each parameter's leaf gradients as the fixed tree (this rank's leaves, then `_across` the group)."""

    @staticmethod
    def forward(ctx, g: TPGroup, leaves: int, *params):
        ctx.g, ctx.leaves = g, leaves
        return tuple(p.clone() for _ in range(leaves) for p in params)  # leaf-major

    @staticmethod
    def backward(ctx, *grads):
        n = len(grads) // ctx.leaves
        subtrees = [_tree(torch.stack(grads[i::n])) for i in range(n)]  # each parameter's leaves, in order
        if len({t.dtype for t in subtrees}) == 1:  # one collective for all of them
            flat = _across(torch.cat([t.reshape(-1) for t in subtrees]), ctx.g)
            summed = [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in subtrees]), subtrees)]
        else:
            summed = [_across(t, ctx.g) for t in subtrees]
        return (None, None, *summed)


def invariant_column_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            g: TPGroup, sequence_parallel: bool = False, parts: Optional[Sequence[int]] = None,
                            siblings: Optional[Siblings] = None) -> torch.Tensor:
    """The column layer of ``tp_invariant``: ``x`` (..., s, in) replicated (``(..., s/p, in)`` with
    ``sequence_parallel``), ``weight`` (out/p, in); ``parts``: this rank's rows of each fused component (q, k, v),
    each split evenly (default: one). ``siblings``: the layer's declared set (at every degree, TP 1 included):
    the members called on one input share one cross-rank step, their leaves added leaf by leaf."""
    parts = tuple(int(n) for n in parts) if parts else (weight.shape[0],)
    for n in parts:
        check_invariant(g.size, "invariant_column_linear", n * g.size)
    if not joins_siblings(siblings, x, g, collective_matmul=False, invariant=True):
        return _InvariantColumnFn.apply(x, weight, bias, g, sequence_parallel, parts)
    call, x = siblings.join(x, g, weight, sequence_parallel, dtype=None, may_reorder=False)  # (no autocast cast)
    if call.token is None:  # the call's first member: its entry
        call.enter(_InvariantEntry.apply(call, x), overlap=False, taken=())
    return _InvariantColumnFn.apply(call.token, weight, bias, g, sequence_parallel, parts, call, call.views[0],
                                    x if sequence_parallel else call.token)


def invariant_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         g: TPGroup, sequence_parallel: bool = False) -> torch.Tensor:
    """The row layer of ``tp_invariant``: ``x`` (..., s, in/p) split, ``weight`` (out, in/p); the output
    ``(..., s, out)`` (``(..., s/p, out)`` with ``sequence_parallel``)."""
    check_invariant(g.size, "invariant_row_linear", weight.shape[1] * g.size)
    return _InvariantRowFn.apply(x, weight, bias, g, sequence_parallel)


def leaf_copies(params: Sequence[torch.Tensor], leaves: int, g: TPGroup) -> List[Tuple[torch.Tensor, ...]]:
    """For a replicated module run on ``leaves`` consecutive pieces of this rank's part of a split input (its
    ``LEAVES / p`` leaves: a norm on this rank's chunk of the sequence, a per-head norm on its heads): one copy of
    ``params`` per leaf, whose gradients are summed as the fixed tree over all ``LEAVES`` leaves of the group, so
    the parameters' gradients are the same bits at every TP degree."""
    copies = _LeafCopies.apply(g, leaves, *params)
    return [tuple(copies[j * len(params):(j + 1) * len(params)]) for j in range(leaves)]


def tree_sums(parts: torch.Tensor, g: TPGroup, exact: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``parts`` (N, k, V/p): k sums per row over this rank's consecutive V/p of a split dimension (a vocabulary
    shard), each summed as the fixed tree over its ``LEAVES`` leaves of V/8 across the group: (N, k), the same on
    every rank (the vocabulary-parallel softmax's sums). ``exact`` (N, j): values nonzero on one rank only (the
    target logit), summed over the group in the same collective, first: (N, j + k)."""
    leaves = LEAVES // g.size
    n, k, width = parts.shape
    check_invariant(g.size, "tree_sums", width * g.size)
    leaf_sums = parts.reshape(n, k, leaves, width // leaves).sum(-1)  # (N, k, leaves)
    local = _tree(leaf_sums.permute(2, 0, 1).contiguous())  # (N, k): this rank's subtree
    return _across(local if exact is None else torch.cat([exact, local], dim=-1), g)
