"""ParallelGPT vs DenseGPT: logits, loss (ignored targets included) and every parameter's gradient."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tplayers import GPTConfig, ParallelGPT
from tplayers.models.dense import DenseGPT
from tplayers.testing import dense_parameters, get_world

from conftest import examples
from _helpers import F64, TP_SIZES, _check_layouts


def _check_gpt(group, config, batch, seq, sequence_parallel, seed):
    torch.manual_seed(seed)
    dense = DenseGPT(config, dtype=F64)
    tp = ParallelGPT.from_dense(dense, group=group, sequence_parallel=sequence_parallel)
    _check_layouts(tp, dense, group)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    targets = torch.randint(0, config.vocab_size, (batch, seq))
    targets[0, 0] = -100
    tol = dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(tp.logits(ids), dense(ids), **tol)
    tp.zero_grad(set_to_none=True)
    loss, dense_loss = tp.loss(ids, targets), dense.loss(ids, targets)
    torch.testing.assert_close(loss, dense_loss, **tol)
    loss.backward()
    dense_loss.backward()
    grads = dense_parameters(tp, grads=True)
    assert set(grads) == {n for n, _ in dense.named_parameters()}
    for name, p in dense.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **tol, msg=name)
    return float(loss.detach())


@pytest.mark.parametrize("tp", TP_SIZES)
@settings(max_examples=examples(3))  # 4 until stop 34 (suite time: 12 s at TP 4)
@given(vocab=st.integers(3, 13), activation=st.sampled_from(["gelu", "swiglu"]),
       norm=st.sampled_from(["layernorm", "rmsnorm"]), n_kv=st.sampled_from([1, 2, 4]), batch=st.integers(1, 2),
       sequence_parallel=st.booleans(), seed=st.integers(0, 2**16))
def test_gpt_logits_loss_and_grads_match_dense(tp, vocab, activation, norm, n_kv, batch, sequence_parallel, seed):
    config = GPTConfig(hidden=8, n_heads=4, ffn_hidden=8, n_kv_heads=n_kv, activation=activation, norm=norm,
                       vocab_size=vocab, n_layers=2)
    losses = get_world(tp).run(_check_gpt, config, batch, 4, sequence_parallel, seed)
    assert len(set(losses)) == 1
