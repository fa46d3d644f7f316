"""ParallelAttention vs DenseAttention: grouped-query heads (replicated when fewer KV heads than
ranks), causal and rotary, boolean, additive and key-padding masks, sequence parallelism."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tplayers
from tplayers import ParallelAttention
from tplayers.models.dense import DenseAttention
from tplayers.testing import assert_matches_dense, get_world

from conftest import examples
from _helpers import F64, TP_SIZES, _WithMask, _check_layouts, _io_dims, _make_mask


heads = st.sampled_from([(4, 4), (4, 2), (4, 1), (8, 2), (8, 8), (8, 4)])


def _check_attention(group, hidden, n_heads, n_kv, head_dim, causal, rotary, mask_kind, batch, seq,
                     sequence_parallel, seed, split_backward=False, chunks=1, delay_wgrad=False):
    torch.manual_seed(seed)
    dense = DenseAttention(hidden, n_heads, n_kv, head_dim, True, causal, rotary, dtype=F64)
    tp = ParallelAttention.from_dense(dense, group=group, sequence_parallel=sequence_parallel,
                                      split_backward=split_backward, chunks=chunks)
    tplayers.set_overlap(tp, delay_wgrad=delay_wgrad)
    _check_layouts(tp, dense, group)
    mask = _make_mask(mask_kind, batch, n_heads, seq, torch.Generator().manual_seed(seed))
    x = torch.randn(batch, seq, hidden, dtype=F64)
    return assert_matches_dense(_WithMask(tp, mask), _WithMask(dense, mask), x, group=group,
                                **_io_dims(sequence_parallel)).grad_error


def _check_key_padding_mask(group, kind, causal, sequence_parallel):
    """A (b, 1, 1, s) key-padding mask acts as the same mask expanded to (b, 1, s, s)."""
    torch.manual_seed(0)
    b, s = 2, 4
    dense = DenseAttention(8, 4, 2, causal=causal, dtype=F64)
    tp = ParallelAttention.from_dense(dense, group=group, sequence_parallel=sequence_parallel)
    keep = torch.tensor([[True, True, True, False], [True, False, True, True]])[:, None, None, :]  # (b, 1, 1, s)
    mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=F64).masked_fill(~keep, -1e4)
    x = torch.randn(b, s, 8, dtype=F64)
    assert_matches_dense(_WithMask(tp, mask), _WithMask(dense, mask.expand(b, 1, s, s)), x, group=group,
                         **_io_dims(sequence_parallel))


@pytest.mark.parametrize("tp", [1, 2])  # TP 2 under sequence parallelism
def test_attention_key_padding_mask_broadcasts_over_queries(tp):
    for kind in ("bool", "float"):
        for causal in (False, True):
            get_world(tp).run(_check_key_padding_mask, kind, causal, tp == 2)


@pytest.mark.parametrize("tp", TP_SIZES)
@settings(max_examples=examples(12))
@given(hidden=st.integers(1, 8), heads=heads, head_dim=st.sampled_from([2, 4]), causal=st.booleans(),
       rotary=st.booleans(), mask_kind=st.sampled_from(["none", "bool", "float"]), batch=st.integers(1, 3),
       seq=st.sampled_from([4, 8]), sequence_parallel=st.booleans(), seed=st.integers(0, 2**16),
       split_backward=st.booleans(), chunks=st.sampled_from([1, 1, 2, 3]), delay_wgrad=st.booleans())
def test_attention_matches_dense(tp, hidden, heads, head_dim, causal, rotary, mask_kind, batch, seq, sequence_parallel,
                                 seed, split_backward, chunks, delay_wgrad):
    n_heads, n_kv = heads
    get_world(tp).run(_check_attention, hidden, n_heads, n_kv, head_dim, causal, rotary, mask_kind, batch, seq,
                      sequence_parallel, seed, split_backward, chunks, delay_wgrad)


def test_gqa_with_fewer_kv_heads_than_ranks_replicates_them():
    # 4 query heads, 1 KV head, 4 ranks: every rank holds the same KV head; its weight gradient is
    # the sum over all four ranks' query heads (checked against dense inside)
    get_world(4).run(_check_attention, 6, 4, 1, 2, True, True, "none", 2, 4, False, 7)
    get_world(4).run(_check_attention, 6, 8, 2, 2, False, False, "bool", 1, 4, True, 8)
