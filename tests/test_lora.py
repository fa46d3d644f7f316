"""PEFT's LoRA on a parallelized model: PEFT first on the dense model, then ``parallelize``; the
adapter's factors are split to match their base layer (tplayers.layers.lora). Training the LoRA (and
DoRA) at TP 2 and 4 follows training it on the dense model (float64), and what cannot be split is
refused."""
import collections
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import tplayers  # noqa: E402
from tplayers import testing  # noqa: E402
from tplayers.testing import dense_parameters, get_world  # noqa: E402

testing.FORKSERVER_PRELOAD.extend(["transformers.models.llama.modeling_llama", "peft"])
VOCAB = 96
TARGETS = ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # column and row layers


def _lora_llama(targets, seed=0, **lora):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    base = LlamaForCausalLM(cfg).double().eval()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, **{"lora_dropout": 0.0, **lora},
                             init_lora_weights=False)  # random lora_B: the adapter changes the output from the start
    return peft.get_peft_model(base, config)


def _train(group, targets, wrapper, dropout=0.0, saved=(), dora=False, embeds=False, steps=5):
    dense = _lora_llama(targets, lora_dropout=dropout, **({"modules_to_save": list(saved)} if saved else {}),
                        **({"use_dora": True} if dora else {}))
    if dropout:  # training mode: the adapters' dropout draws masks (both models from the same seed each step)
        dense.train()
    model = copy.deepcopy(dense)
    # the transformers model inside PEFT's wrapper, or the PeftModel itself ("auto" reads through it)
    tplayers.parallelize(model if wrapper else model.base_model.model, "auto", group=group)
    opt_d = torch.optim.SGD([p for p in dense.parameters() if p.requires_grad], lr=0.5)
    opt_t = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (2, 10), generator=g)
        # embeds: the embeddings are the input, a leaf on both sides, so the input gradient is compared too
        x = dense.get_input_embeddings()(ids).detach() if embeds else None
        inputs = [{"inputs_embeds": x.clone().requires_grad_(True)} if embeds else {"input_ids": ids} for _ in range(2)]
        torch.manual_seed(10 + step)
        out_d = dense(**inputs[0], labels=ids)
        torch.manual_seed(10 + step)
        out_t = model(**inputs[1], labels=ids)
        if step == 0:  # the first forward audited each region, the adapters' twins included
            audit = tplayers.coverage(model if wrapper else model.base_model.model).audit
            # (fed embeddings, the embedding is never called: its audit stays pending)
            assert all(r.status == "passed" or (embeds and r.name.endswith("embed_tokens")) for r in audit.regions), \
                str(audit)
        torch.testing.assert_close(out_t.logits, out_d.logits, rtol=1e-9, atol=1e-9)
        out_d.loss.backward(), out_t.loss.backward()
        if embeds:
            torch.testing.assert_close(inputs[1]["inputs_embeds"].grad, inputs[0]["inputs_embeds"].grad,
                                       rtol=1e-9, atol=1e-12, msg=lambda m: f"step {step}, input gradient: {m}")
        grads = dense_parameters(model, grads=True)
        trained = [n for n, p in dense.named_parameters() if p.requires_grad]
        for name in trained:
            torch.testing.assert_close(grads[name], dict(dense.named_parameters())[name].grad, rtol=1e-9, atol=1e-12,
                                       msg=lambda m: f"step {step}, grad of {name}: {m}")
        tplayers.check_replicas(model)
        opt_d.step(), opt_t.step()
        opt_d.zero_grad(), opt_t.zero_grad()
    params = dense_parameters(model)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")
    # in eval (no dropout; DoRA reuses the base layer's output), then merged by PEFT's own merge, which works
    # on the shards: the TP model computes the same logits
    ids = torch.randint(0, VOCAB, (2, 6), generator=g)
    dense.eval(), model.eval()
    with torch.no_grad():
        want = dense(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-9, atol=1e-9)
        model.merge_adapter()
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-9, atol=1e-9)
    return str(tplayers.coverage(model if wrapper else model.base_model.model)), len(trained)


@pytest.mark.parametrize("tp, wrapper, dropout, saved", [(2, False, 0.0, ()), (4, False, 0.1, ()),
                                                        (2, True, 0.1, ("embed_tokens", "lm_head"))])
def test_training_a_lora_on_tp_layers_follows_the_dense_lora(tp, wrapper, dropout, saved):
    """lora_dropout 0.1 (published adapters use 0.05-0.1), in training: the same masks as the dense LoRA's
    (column layers: PEFT's dropout on the whole input, the ranks' generators agreeing; row layers: the
    whole-width mask, this rank's columns), so the same losses and gradients. modules_to_save (the recipe
    after adding tokens): the embedding's and the head's trainable copies are split like them and train."""
    targets = TARGETS + ["v_proj"]  # at TP 4 the 2 KV heads are replicated: lora_B's rows summed over replicas
    for report, trained in get_world(tp).run(_train, targets, wrapper, dropout, saved):
        assert "q_proj: PEFT LoRA over ColumnParallelLinear (x2)" in report
        assert "down_proj: PEFT LoRA over RowParallelLinear (x2)" in report
        assert trained == 2 * 2 * len(targets) + len(saved)  # lora_A and lora_B of each target, 2 layers; the copies
        if saved:
            assert "embed_tokens: PEFT modules_to_save over VocabParallelEmbedding" in report
            assert "lm_head: PEFT modules_to_save over ParallelLMHead" in report


@pytest.mark.parametrize("tp, wrapper, dropout, embeds", [(2, False, 0.0, False), (4, True, 0.1, True)])
def test_training_a_dora_on_tp_layers_follows_the_dense_dora(tp, wrapper, dropout, embeds):
    """DoRA (use_dora=True): the magnitude vector is split like the output rows on column layers (the
    weight norm of a row is local there) and replicated on row layers, whose weight norm spans the split
    input features (the squared norms summed over the group). Output, input gradient and every adapter
    gradient (lora_A, lora_B, the magnitude) follow the dense DoRA for 5 SGD steps, in training with
    lora_dropout 0.1 too (PEFT then recomputes the base term on the dropped input), and PEFT's DoRA merge
    works on the shards. At TP 4 the 2 KV heads are replicated: v_proj's magnitude rows sum over replicas.
    3 steps: at the first, m = ||W + s B A|| so m / n = 1 and the base term's gradient is zero. TP 2: DoRA on
    the embedding too (no plan entry matches PEFT's embedding wrapper: it stays whole on every rank)."""
    targets = TARGETS + ["v_proj"] + ([] if embeds else ["embed_tokens"])
    for report, trained in get_world(tp).run(_train, targets, wrapper, dropout, (), True, embeds, 3):
        assert "o_proj: PEFT LoRA over RowParallelLinear (x2)" in report
        assert "v_proj: PEFT LoRA over" in report
        assert trained == 3 * (2 * len(TARGETS + ["v_proj"]) + (not embeds))  # lora_A, lora_B and magnitude each


def _collectives(group, dora, dropout):
    """The collectives of one training step (forward and backward), as a multiset of (op, phase, bytes)."""
    model = _lora_llama(TARGETS, use_dora=dora, lora_dropout=dropout).train()
    tplayers.parallelize(model, "auto", group=group)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()  # the first forward's audit and checks: not counted
    with tplayers.comm_accounting(model) as acct:
        model(input_ids=ids, labels=ids).loss.backward()
    return collections.Counter((r.op, r.phase, r.nbytes) for r in acct.records)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_dora_adds_one_small_all_reduce_per_row_layer(dropout):
    """What DoRA adds to LoRA's collectives, at TP 2 (2 layers; q/gate/up column, o/down row; float64).
    Without dropout (and in eval): one all-reduce of the row layer's squared weight-norms (out_features
    elements) in forward per row layer; the norm is detached (as in PEFT), so nothing in backward; column
    layers add nothing. With lora_dropout in training PEFT computes the base term again on the dropped
    input: a row layer sums that partial output (b*s*out, forward), a column layer sums its input gradient
    (b*s*in, backward)."""
    lora, dora = (get_world(2).run(_collectives, d, dropout)[0] for d in (False, True))
    added = dora - lora
    assert not lora - dora  # DoRA drops nothing LoRA does
    tokens, hidden, f64 = 2 * 10, 32, 8
    want = {("all_reduce", "forward", hidden * f64): 2 * 2}  # o_proj and down_proj (out = hidden), 2 layers
    if dropout:
        want[("all_reduce", "forward", tokens * hidden * f64)] = 2 * 2  # the row layers' dropped base term
        # q/gate/up (in = hidden): the dropped input's gradient; not layer 0's q_proj, whose input (the frozen
        # embedding, normed) needs none, so autograd never runs that backward
        want[("all_reduce", "backward", tokens * hidden * f64)] = 2 * 3 - 1
    assert dict(added) == want


def _refusals(group):
    with pytest.raises(TypeError, match=r"module 'model.layers.0.mlp.up_proj': LoRA variants \['default'\] "
                                        r"\(ALoraLinearVariant\)"):
        tplayers.parallelize(_lora_llama(["up_proj"], alora_invocation_tokens=[5]).base_model.model, "auto", group=group)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=16))
    gpt2 = peft.get_peft_model(gpt2, peft.LoraConfig(r=4, target_modules=["c_fc"], use_dora=True, fan_in_fan_out=True))
    with pytest.raises(TypeError, match=r"module 'transformer.h.0.mlp.c_fc': adapter 'default': DoRA as DoraLinearLayer "
                                        r"with fan_in_fan_out=True is not supported"):
        tplayers.parallelize(gpt2.base_model.model, "auto", group=group)
    return True


def test_lora_that_cannot_be_split_is_refused_naming_the_module():
    assert all(get_world(4).run(_refusals))


def _adapter_after_parallelize(group):
    """load_adapter / add_adapter after parallelize: the audit's cause names it (before: it blamed head counts)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
    model = peft.get_peft_model(LlamaForCausalLM(cfg).double(), config)
    tplayers.parallelize(model, "auto", group=group)  # adapter "default": split with its base layers
    model.add_adapter("late", config)  # after parallelize: a dense adapter on the shards
    model.set_adapter("late")
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    with pytest.raises(tplayers.AuditError) as info:
        model(input_ids=ids, labels=ids).loss.backward()
    return str(info.value)


def test_an_adapter_added_after_parallelize_is_named_as_the_cause():
    for message in get_world(2).run(_adapter_after_parallelize):
        assert "were added after parallelize" in message and "before parallelize" in message, message
