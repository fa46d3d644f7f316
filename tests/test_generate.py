"""KV-cache decoding of the library's own models: DenseGPT.generate equals recomputing the whole
prefix each step, and ParallelGPT.generate (each rank caching its KV heads) equals DenseGPT's, at
TP 1, 2, 4 with grouped-query attention (2 KV heads: replicated at TP 4), rotary on and off."""
import pytest
import torch

import tplayers
from tplayers.models.dense import DenseGPT, GPTConfig
from tplayers.models.cache import KVCache
from tplayers.testing import get_world


def _config(rotary: bool) -> GPTConfig:
    return GPTConfig(vocab_size=37, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, n_layers=2, rotary=rotary,
                     activation="swiglu", norm="rmsnorm")


def _dense(rotary: bool) -> DenseGPT:
    torch.manual_seed(0)
    return DenseGPT(_config(rotary)).double().eval()


@pytest.mark.parametrize("rotary", [True, False])
def test_dense_cache_equals_recomputing_the_prefix(rotary):
    model = _dense(rotary)
    ids = torch.randint(0, 37, (3, 5), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=6)
    want = ids
    with torch.no_grad():
        for _ in range(6):  # no cache: the whole sequence every step
            want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(out, want)
        # a prompt fed in two chunks through the cache gives the logits of one full forward
        cache = KVCache(len(model.blocks))
        first, second = model(want[:, :4], cache=cache), model(want[:, 4:], cache=cache)
        torch.testing.assert_close(torch.cat([first, second], dim=1), model(want), rtol=1e-12, atol=1e-12)


def _parallel_generate(group, rotary: bool):
    dense = _dense(rotary)
    model = tplayers.ParallelGPT.from_dense(dense, group=group).eval()
    ids = torch.randint(0, 37, (3, 5), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, max_new_tokens=6)
    assert torch.equal(out, dense.generate(ids, max_new_tokens=6))
    cache, dense_cache = KVCache(2), KVCache(2)
    with torch.no_grad():
        for chunk in (out[:, :5], out[:, 5:6], out[:, 6:]):
            torch.testing.assert_close(model.logits(chunk, cache=cache), dense(chunk, cache=dense_cache),
                                       rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match=r"ParallelAttention: attn_mask together with a KV cache is not supported"):
            model(out[:, :1], attn_mask=torch.ones(1, 1, dtype=torch.bool), cache=cache)
    return cache.layers[0].k.shape[1]  # this rank's KV heads


@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parallel_generate_equals_dense(tp, rotary):
    assert get_world(tp).run(_parallel_generate, rotary) == [max(1, 2 // tp)] * tp


def _sequence_parallel_refused(group):
    model = tplayers.ParallelGPT.from_dense(_dense(True), group=group, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"generate: decoding feeds one token per step, which cannot be split"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), max_new_tokens=1)
    return True


def test_parallel_generate_refuses_sequence_parallel_models():
    assert all(get_world(2).run(_sequence_parallel_refused))


def test_generate_refuses_bad_arguments():
    model = _dense(True)
    with pytest.raises(ValueError, match=r"generate: max_new_tokens=-1 must be >= 0"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=-1)
    with pytest.raises(ValueError, match=r"generate: expected prompt ids \(batch, seq >= 1\), got \(3,\)"):
        model.generate(torch.zeros(3, dtype=torch.long), max_new_tokens=1)
    cache = KVCache(2)
    model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"KV cache: cached keys \(2, 2, 3, 8\) do not fit new keys \(1, 2, 1, 8\)"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
