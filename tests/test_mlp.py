"""ParallelMLP vs DenseMLP: outputs, gradients and parameter layouts, any activation, sequence
parallelism, split backward, chunks and delayed weight gradients."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tplayers
from tplayers import ParallelMLP
from tplayers.models.dense import DenseMLP
from tplayers.testing import assert_matches_dense, get_world

from conftest import examples
from _helpers import F64, TP_SIZES, _check_layouts, _io_dims


def _check_parallel_mlp(group, hidden, ffn, activation, bias, batch, seq, sequence_parallel, seed, split_backward=False,
                        chunks=1, delay_wgrad=False):
    torch.manual_seed(seed)
    dense = DenseMLP(hidden, ffn, activation, bias, dtype=F64)
    tp = ParallelMLP.from_dense(dense, group=group, sequence_parallel=sequence_parallel, split_backward=split_backward,
                                chunks=chunks)
    tplayers.set_overlap(tp, delay_wgrad=delay_wgrad)
    _check_layouts(tp, dense, group)
    x = torch.randn(batch, seq, hidden, dtype=F64)
    return assert_matches_dense(tp, dense, x, group=group, **_io_dims(sequence_parallel)).grad_error


@pytest.mark.parametrize("tp", TP_SIZES)
@settings(max_examples=examples(8))
@given(hidden=st.integers(1, 8), ffn_per_rank=st.integers(1, 3), activation=st.sampled_from(["gelu", "swiglu"]),
       bias=st.booleans(), batch=st.integers(1, 3), seq=st.sampled_from([4, 8]), sequence_parallel=st.booleans(),
       seed=st.integers(0, 2**16), split_backward=st.booleans(), chunks=st.sampled_from([1, 1, 2, 3]),
       delay_wgrad=st.booleans())
def test_mlp_matches_dense(tp, hidden, ffn_per_rank, activation, bias, batch, seq, sequence_parallel, seed,
                           split_backward, chunks, delay_wgrad):
    get_world(tp).run(_check_parallel_mlp, hidden, ffn_per_rank * 4, activation, bias, batch, seq, sequence_parallel,
                      seed, split_backward, chunks, delay_wgrad)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_mlp_activations_backward_by_hand_is_autograds_bit_for_bit(activation, dtype):
    """The MLP region's core computes its input gradient by hand (no backward nested in the region's, SwiGLU's two
    halves written in place of their concatenation): the very ops autograd runs, so the same bits, here on a
    rank-major view too (a region's tokens in the gathered order)."""
    from tplayers.models.activation import Activation

    act = Activation(activation)
    gen = torch.Generator().manual_seed(3)
    width = 12
    h = torch.randn(4, 2, 3, width, generator=gen).to(dtype)  # (p, b, s/p, width)
    grad_a = torch.randn(4, 2, 3, width // 2 if activation == "swiglu" else width, generator=gen).to(dtype)
    h_in = h.clone().requires_grad_()
    a = act(h_in)
    (want,) = torch.autograd.grad(a, h_in, grad_a)
    got_a, got = act.vjp(h, grad_a)
    assert torch.equal(got_a, a.detach()) and torch.equal(got, want)
