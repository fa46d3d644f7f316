"""An evaluation under ``torch.inference_mode()`` before training (Lightning's validation sanity check does it):
nothing made under inference mode is reused outside it. Before: the collectives' process-wide scratch buffer,
made in the evaluation, was summed into in place at the first training all-reduce: "Inplace update to inference
tensor outside InferenceMode", which the audit called a fault of the plan."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tplayers  # noqa: E402
from tplayers.testing import dense_parameters, get_world  # noqa: E402

V = 64


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).double()


def _evaluate_then_train(group, sequence_parallel, audit):
    dense = _llama()
    model = tplayers.parallelize(copy.deepcopy(dense), "llama", group=group, sequence_parallel=sequence_parallel,
                                 audit=audit)
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    for m in (dense, model):
        m.eval()
    with torch.inference_mode():
        evaluated = model(ids).logits
        assert torch.allclose(evaluated, dense(ids).logits, rtol=1e-10, atol=1e-12)
    for m in (dense, model):
        m.train()
    for step in range(2):
        loss_t, loss_d = model(ids, labels=ids).loss, dense(ids, labels=ids).loss
        assert torch.allclose(loss_t, loss_d, rtol=1e-10), (step, float(loss_t), float(loss_d))
        loss_t.backward(), loss_d.backward()
    grads = dense_parameters(model, grads=True)
    worst = max(float((grads[n] - p.grad).abs().max()) for n, p in dense.named_parameters())
    with torch.inference_mode():  # and evaluating again after training
        again = model(ids).logits
    return worst < 1e-10, torch.allclose(again, dense(ids).logits, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sequence_parallel, audit", [(False, True), (True, False)])
def test_evaluation_under_inference_mode_before_training(sequence_parallel, audit):
    assert get_world(2).run(_evaluate_then_train, sequence_parallel, audit) == [(True, True)] * 2
