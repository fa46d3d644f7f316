"""ParallelTransformerBlock vs DenseTransformerBlock (float64 property test, float32 at the default
tolerance, sequence parallel equal to plain TP), and the clear errors that the block's layers
raise for shapes and settings they cannot split."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from tplayers import BlockConfig, VocabParallelEmbedding, ParallelAttention, ParallelMLP, ParallelTransformerBlock
from tplayers.core.comm import gather_from_sequence, scatter_to_sequence
from tplayers.models.dense import DenseTransformerBlock
from tplayers.core.groups import TPGroup, resolve_group
from tplayers.testing import dense_parameters, get_world

from conftest import examples
from _helpers import F64, MULTI_RANK, TP_SIZES, _check_block, configs


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_block_float32_within_default_tolerance(tp):
    # fp32: only the order of the partial sums differs from dense (rtol 1e-4, atol 1e-5)
    config = BlockConfig(hidden=16, n_heads=4, ffn_hidden=32, n_kv_heads=2, activation="swiglu", norm="rmsnorm",
                         rotary=True)
    get_world(tp).run(_check_block, config, 2, 8, "bool", True, 1, torch.float32)


@pytest.mark.parametrize("tp", TP_SIZES)
@settings(max_examples=examples(8))
@given(config=configs, batch=st.integers(1, 2), seq=st.sampled_from([4, 8]),
       mask_kind=st.sampled_from(["none", "bool"]), sequence_parallel=st.booleans(), seed=st.integers(0, 2**16))
def test_block_matches_dense(tp, config, batch, seq, mask_kind, sequence_parallel, seed):
    get_world(tp).run(_check_block, config, batch, seq, mask_kind, sequence_parallel, seed)


def _block_sp_equals_no_sp(group, config, seed):
    """The same block with and without sequence parallelism: equal outputs and gradients."""
    g = resolve_group(group)
    torch.manual_seed(seed)
    dense = DenseTransformerBlock(config, dtype=F64)
    x = torch.randn(2, 8, config.hidden, dtype=F64)
    results = []
    for sp in (False, True):
        tp = ParallelTransformerBlock.from_dense(dense, group=group, sequence_parallel=sp)
        xi = x.clone().requires_grad_()
        out = tp(scatter_to_sequence(xi, group=group) if sp else xi)
        out = gather_from_sequence(out, group=group, grad_is_partial=False) if sp else out
        (out * torch.arange(out.numel(), dtype=F64).reshape(out.shape).sin()).sum().backward()
        results.append((out.detach(), xi.grad, dense_parameters(tp, grads=True)))
    (o0, gx0, gp0), (o1, gx1, gp1) = results
    torch.testing.assert_close(o1, o0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx1, gx0, rtol=1e-12, atol=1e-12)
    for name in gp0:
        torch.testing.assert_close(gp1[name], gp0[name], rtol=1e-12, atol=1e-12, msg=name)
    return g.rank


def test_block_sequence_parallel_equals_tensor_parallel():
    config = BlockConfig(hidden=8, n_heads=4, ffn_hidden=8, n_kv_heads=2, activation="swiglu", norm="rmsnorm",
                         rotary=True)
    assert get_world(2).run(_block_sp_equals_no_sp, config, 3) == [0, 1]


# ------------------------------------------------------------------ errors


def _fake_group(n, rank=0):
    """A TPGroup of size n for checks that fail before any communication."""
    return TPGroup(object(), rank, n)


def test_bad_inputs_raise_clear_errors():
    two = _fake_group(2)
    with pytest.raises(ValueError, match="ParallelAttention: n_heads=3 is not divisible by the TP degree 2"):
        ParallelAttention(12, 3, 3, 4, group=two)
    with pytest.raises(ValueError, match="n_kv_heads=3 is not divisible by the TP degree 2"):
        ParallelAttention(12, 6, 3, 4, group=two)
    with pytest.raises(ValueError, match="n_kv_heads=3 is fewer than the TP degree 4 and does not divide it"):
        ParallelAttention(12, 12, 3, 4, group=_fake_group(4))
    with pytest.raises(ValueError, match="n_heads=4 is not a multiple of n_kv_heads=3"):
        ParallelAttention(16, 4, 3, group=None)
    with pytest.raises(ValueError, match="needs rng="):
        ParallelTransformerBlock(BlockConfig(hidden=8, n_heads=2, ffn_hidden=8, dropout=0.1), group=two)
    with pytest.raises(ValueError, match=r"dropout=1.5 must be in \[0, 1\)"):  # the real problem, not the rng
        ParallelTransformerBlock(BlockConfig(hidden=8, n_heads=2, ffn_hidden=8, dropout=1.5), group=two)
    with pytest.raises(ValueError, match="ffn_hidden=5 is not divisible by the TP degree 2"):
        ParallelMLP(4, 5, group=two)
    # sequence parallelism: a sequence that does not split evenly is refused when it is scattered
    with pytest.raises(ValueError, match="size 3 is not divisible by the TP degree 2"):
        scatter_to_sequence(torch.randn(1, 3, 8), group=two)
    with pytest.raises(ValueError, match="sequence length .* not divisible by the TP degree 2"):
        VocabParallelEmbedding(8, 4, group=two, sequence_parallel=True, device="meta")(torch.zeros(1, 3, dtype=torch.long))
    attn = ParallelAttention(8, 2, group=None)
    with pytest.raises(ValueError, match="attn_mask of shape"):
        attn(torch.randn(1, 4, 8), torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"expected input \(batch, seq, hidden\)"):
        attn(torch.randn(4, 8))
    with pytest.raises(ValueError, match="last dim"):
        attn(torch.randn(1, 4, 7))
    with pytest.raises(ValueError, match="even head_dim"):
        ParallelAttention(6, 2, rotary=True, group=None)
    with pytest.raises(TypeError, match="DenseMLP"):
        ParallelMLP.from_dense(nn.Linear(2, 2), group=None)
