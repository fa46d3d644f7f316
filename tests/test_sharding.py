"""Pure sharding functions: shard/unshard round trips, resharding between TP sizes, fused and
replicated-KV layouts, Conv1D transposition. No processes: fast."""
import pytest
import torch
from hypothesis import given, settings

from conftest import examples
from hypothesis import strategies as st

from tplayers.core.placement import Replicated, Sharded
from tplayers.io.state_dict import (
    conv1d_to_linear_weight,
    fuse,
    fused_layout,
    linear_to_conv1d_weight,
    qkv_layout,
    reshard_state_dict,
    shard_state_dict,
    split_fused,
    unshard_state_dict,
)


def _layouts(tp: int, heads: int, kv_heads: int, head_dim: int, hidden: int):
    return {
        "col.weight": Sharded.split(0, 4 * hidden, tp),
        "row.weight": Sharded.split(1, 4 * hidden, tp),
        "gate_up.weight": fused_layout([4 * hidden, 4 * hidden], tp),
        "qkv.weight": qkv_layout(heads, kv_heads, head_dim, tp),
        "norm.weight": Replicated(),
    }


def _full(heads: int, kv_heads: int, head_dim: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        "col.weight": torch.randn(4 * hidden, hidden, generator=g),
        "row.weight": torch.randn(hidden, 4 * hidden, generator=g),
        "gate_up.weight": torch.randn(8 * hidden, hidden, generator=g),
        "qkv.weight": torch.randn((heads + 2 * kv_heads) * head_dim, hidden, generator=g),
        "norm.weight": torch.randn(hidden, generator=g),
        "step": torch.tensor(3),
    }


gqa = st.sampled_from([(4, 4), (4, 2), (4, 1), (8, 2)])  # (heads, kv_heads)


@settings(max_examples=examples(15))
@given(gqa=gqa, head_dim=st.sampled_from([2, 4]), src=st.sampled_from([1, 2, 4]), dst=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**16))
def test_reshard_round_trips_exactly(gqa, head_dim, src, dst, seed):
    heads, kv = gqa
    hidden = 8
    full = _full(heads, kv, head_dim, hidden, seed)
    locals_src = [shard_state_dict(full, _layouts(src, heads, kv, head_dim, hidden), r, src) for r in range(src)]
    locals_dst = reshard_state_dict(locals_src, _layouts(src, heads, kv, head_dim, hidden),
                                    _layouts(dst, heads, kv, head_dim, hidden), dst)
    assert len(locals_dst) == dst
    for r, sd in enumerate(locals_dst):  # each destination rank holds exactly its direct shard
        direct = shard_state_dict(full, _layouts(dst, heads, kv, head_dim, hidden), r, dst)
        assert all(torch.equal(sd[k], direct[k]) for k in full)
    back = unshard_state_dict(locals_dst, _layouts(dst, heads, kv, head_dim, hidden))
    assert all(torch.equal(back[k], full[k]) for k in full)


def test_fused_shard_never_crosses_components():
    q, k, v = torch.full((4, 2), 1.0), torch.full((4, 2), 2.0), torch.full((4, 2), 3.0)
    w = fuse([q, k, v])
    layout = fused_layout([4, 4, 4], 2)
    local = layout.shard(w, 1, 2)
    assert local[:, 0].tolist() == [1, 1, 2, 2, 3, 3]
    assert [t.shape[0] for t in split_fused(w, [4, 4, 4])] == [4, 4, 4]


def test_qkv_layout_replicates_kv_heads_when_fewer_than_ranks():
    heads, kv, hd = 4, 1, 2
    w = torch.arange((heads + 2 * kv) * hd).float().unsqueeze(1)
    layout = qkv_layout(heads, kv, hd, 4)
    shards = [layout.shard(w, r, 4).squeeze(1).tolist() for r in range(4)]
    assert shards[0] == [0, 1, 8, 9, 10, 11] and shards[3] == [6, 7, 8, 9, 10, 11]
    # refused before; now whole heads as evenly as possible (tests/test_uneven.py): 6 heads / 2 KV heads at TP 4,
    # each KV head on two ranks, its 3 query heads 2 + 1; 3 KV heads at TP 4 held by 2, 1, 1 ranks
    q, k, v = qkv_layout(6, 2, 2, 4).parts
    assert q.counts == (4, 2, 4, 2) and k == v and k.shards == 2 and k.holders is None
    q, k, _ = qkv_layout(12, 3, 2, 4).parts
    assert q.counts == (4, 4, 8, 8) and k.holders == (2, 1, 1)
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        qkv_layout(6, 4, 2, 2)


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="col.weight"):
        shard_state_dict({"col.weight": torch.zeros(6, 2)}, {"col.weight": Sharded.split(0, 8, 2)}, 0, 2)
    with pytest.raises(ValueError, match="rank 1"):
        unshard_state_dict([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], {})


def test_unshard_refuses_locals_of_another_tp_size():
    """Locals of 3 ranks under a TP-4 layout used to rebuild rank 0's rows four times, silently."""
    full = {"w": torch.randn(8, 3)}
    tp4 = {"w": Sharded.split(0, 8, 4)}
    locals4 = [shard_state_dict(full, tp4, r, 4) for r in range(4)]
    with pytest.raises(ValueError, match=r"w: .*3 ranks.*4 shards"):
        unshard_state_dict(locals4[:3], tp4)
    with pytest.raises(ValueError, match=r"w: rank 0's local tensor has size 2 along dim 0, the placement expects 4"):
        unshard_state_dict(locals4[:2], {"w": Sharded.split(0, 8, 2)})
    torch.testing.assert_close(unshard_state_dict(locals4, tp4)["w"], full["w"], rtol=0, atol=0)


def test_conv1d_transposition_round_trips():
    w = torch.randn(3, 5)  # Conv1D (in, out)
    lin = conv1d_to_linear_weight(w)
    assert lin.shape == (5, 3) and lin.is_contiguous()
    x = torch.randn(2, 3)
    torch.testing.assert_close(x @ w, torch.nn.functional.linear(x, lin))
    assert torch.equal(linear_to_conv1d_weight(lin), w)
