"""A converted Hugging Face attention under sequence parallelism gathers its input in the collective's rank-major
token order once its first forward has shown that only its shape and its q / k / v read it
(tplayers/convert/gather_dtype.py: SortGather): equal to the dense model at every step, and in the sequence's order
wherever other code could see the gathered tensor (a hook registered later, a deep copy of the model)."""
import copy

import pytest
import torch

import tplayers
from tplayers.testing import get_world

from _helpers import Calls

pytest.importorskip("transformers")


def _rank_major_gathers():
    """Counts the rank-major gathers for a module's code (gather_sequence_for_columns(rank_major=True)) here."""
    import tplayers.core.comm as comm

    return Calls(comm, "gather_rank_major_from_sequence")


def _steps(group):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2)
    dense = LlamaForCausalLM(cfg).double()
    model = tplayers.parallelize(copy.deepcopy(dense), "auto", group=group, sequence_parallel=True)
    seen, seen_dense = [], []
    gathers = []
    for step in range(4):
        if step == 2:  # user code looks at the attention's input from now on
            model.model.layers[1].self_attn.register_forward_pre_hook(
                lambda m, args, kwargs: seen.append(kwargs["hidden_states"].detach()), with_kwargs=True)
            dense.model.layers[1].self_attn.register_forward_pre_hook(
                lambda m, args, kwargs: seen_dense.append(kwargs["hidden_states"].detach()), with_kwargs=True)
        ids = torch.randint(0, 64, (3, 2 * group.size()), generator=torch.Generator().manual_seed(step))
        with _rank_major_gathers() as counted:
            loss = (copy.deepcopy(model) if step == 3 else model)(input_ids=ids, labels=ids).loss
            loss.backward()
        loss_d = dense(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, loss_d, rtol=1e-9, atol=1e-9)
        gathers.append(counted.n)
    for got, want in zip(seen, seen_dense):  # the hook saw the sequence in its order
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    return gathers, len(seen)


def test_an_attention_gathers_rank_major_only_where_nothing_else_sees_it():
    """Step 1: layer 0 watched inside the audit's run, layer 1 in the forward; step 2: both rank-major; step 3: a
    hook on layer 1's attention keeps its gather in the sequence's order (the hook sees the dense input); step 4: a
    deep copy of the model gathers in the sequence's order."""
    for gathers, hooked in get_world(2).run(_steps):
        assert gathers == [1, 2, 1, 0] and hooked == 2, (gathers, hooked)


def _patched_attention(group):
    """After the watch (step 2 gathers rank-major), user code swaps the attention class's forward for one that reads
    its input's values itself, with no hook: the gather goes back to the sequence's order (the forward it watched is
    not the one that runs), and what the new forward reads equals the dense attention's input."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaAttention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8,
                      num_key_value_heads=2)
    dense = LlamaForCausalLM(cfg).double()
    model = tplayers.parallelize(copy.deepcopy(dense), "auto", group=group, sequence_parallel=True)
    ids = torch.randint(0, 64, (3, 2 * group.size()), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    stock, seen = LlamaAttention.forward, []

    def reading(self, hidden_states, *args, **kwargs):
        seen.append(hidden_states.detach().clone())
        return stock(self, hidden_states, *args, **kwargs)

    LlamaAttention.forward = reading
    try:
        with _rank_major_gathers() as counted:
            model(input_ids=ids, labels=ids).loss.backward()
        dense(input_ids=ids, labels=ids)
    finally:
        LlamaAttention.forward = stock
    torch.testing.assert_close(seen[0], seen[1], rtol=1e-9, atol=1e-9)  # (TP's, then dense's)
    return counted.n


def test_an_attention_forward_swapped_after_the_watch_is_watched_again():
    assert get_world(2).run(_patched_attention) == [0, 0]
