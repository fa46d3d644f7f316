"""Hugging Face models (tiny, built from a config with random weights; no download): the shipped
"llama" and "gpt2" plans give the dense model's logits, loss and gradients at TP 2 and 4; HF
safetensors checkpoints load straight into TP models and back out; TP checkpoints reshard."""
import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tplayers  # noqa: E402
from tplayers import testing  # noqa: E402
from tplayers.testing import dense_parameters, get_world  # noqa: E402

# Ranks fork from a server that imports these once (pytest collects every module before the
# first world starts), instead of each of the 7 ranks importing the model code on its own.
testing.FORKSERVER_PRELOAD.extend(["transformers.models.llama.modeling_llama",
                                   "transformers.models.gpt2.modeling_gpt2", "transformers.models.opt.modeling_opt"])

VOCAB = 96  # divisible by 2 and 4, so GPT-2's tied head and embedding keep one layout without padding


def _llama(kv_heads: int = 4, seed: int = 0, heads: int = 8, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=4 * heads, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32,
                      tie_word_embeddings=False, attn_implementation=attn)
    return LlamaForCausalLM(cfg).double().eval()


def _gpt2(seed: int = 0, vocab: int = VOCAB):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).double().eval()


def _opt(seed: int = 0):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=32, word_embed_proj_dim=32, pad_token_id=1, dropout=0.0)
    return OPTForCausalLM(cfg).double().eval()


BUILD = {"llama": _llama, "gpt2": _gpt2, "opt": _opt}


def _assert_lm_matches(model, dense, ids):
    """Logits, loss and every parameter gradient of the TP model equal the dense model's; the logits."""
    out_d, out_t = dense(ids, labels=ids), model(ids, labels=ids)
    torch.testing.assert_close(out_t.logits, out_d.logits, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out_t.loss, out_d.loss, rtol=1e-9, atol=1e-9)
    out_d.loss.backward()
    out_t.loss.backward()
    grads = dense_parameters(model, grads=True)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    return out_t, out_d


def _check_model(group, family: str, seed: int, **config):
    dense = BUILD[family](seed=seed, **config)
    model = tplayers.parallelize(copy.deepcopy(dense), family, group=group)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, dense.config.vocab_size, (2, 10), generator=g)
    out_t, out_d = _assert_lm_matches(model, dense, ids)
    swapped = sorted({type(m).__name__ for m in model.modules() if isinstance(m, tplayers.TensorParallelModule)})
    return float((out_t.logits - out_d.logits).abs().max()), swapped


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_shipped_plan_matches_dense(family, tp):
    for err, swapped in get_world(tp).run(_check_model, family, seed=tp):
        assert err < 1e-9
        if family == "gpt2":
            assert "FusedColumnParallelConv1D" in swapped and "RowParallelConv1D" in swapped
        assert "VocabParallelEmbedding" in swapped and "ParallelLMHead" in swapped


@pytest.mark.parametrize("attn", ["sdpa", "eager"])  # eager repeats KV heads by num_key_value_groups
def test_llama_gqa_with_fewer_kv_heads_than_ranks_matches_dense(attn):
    """2 KV heads at TP 4: each KV head is replicated on 2 ranks, gradients summed over replicas."""
    for err, swapped in get_world(4).run(_check_model, "llama", seed=3, kv_heads=2, attn=attn):
        assert err < 1e-9 and "FusedColumnParallelLinear" in swapped


def test_gpt2_vocab_not_divisible_by_tp_is_padded_and_stays_tied():
    """GPT-2's real vocabulary (50257) does not divide the TP degree: 50 at TP 4 is padded to 52."""
    for err, swapped in get_world(4).run(_check_model, "gpt2", seed=4, vocab=50):
        assert err < 1e-9 and "ParallelLMHead" in swapped


def _heads_that_do_not_divide(group, heads: int, kv_heads: int, sequence_parallel: bool):
    """Refused by the "llama" plan before (3 KV heads at TP 4; 6 heads at TP 4): now whole heads as evenly as
    possible, equal to dense, with and without sequence parallelism."""
    dense = _llama(kv_heads=kv_heads, heads=heads, seed=3)
    model = tplayers.parallelize(copy.deepcopy(dense), "llama", group=group, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    _assert_lm_matches(model, dense, ids)
    tplayers.check_replicas(model)
    return sorted(tplayers.coverage(model).uneven)


@pytest.mark.parametrize("heads, kv_heads, sequence_parallel", [(12, 3, False), (6, 2, True)])
def test_llama_plan_splits_heads_that_do_not_divide_the_tp_degree(heads, kv_heads, sequence_parallel):
    for uneven in get_world(4).run(_heads_that_do_not_divide, heads, kv_heads, sequence_parallel):
        assert "model.layers.0.self_attn.q_proj.weight" in uneven, uneven


def _hf_roundtrip(group, src_dir: str, out_dir: str):
    """HF save_pretrained dir -> TP model (load_dense) -> save_dense -> HF from_pretrained."""
    from transformers import GPT2LMHeadModel

    dense = _gpt2(seed=11)
    model = tplayers.parallelize(_gpt2(seed=12), "gpt2", group=group)  # different weights until loaded
    missing, _ = tplayers.load_dense(model, src_dir)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-9, atol=1e-9)
    tplayers.save_dense(model, f"{out_dir}/model.safetensors")  # collective; creates out_dir, writes config.json
    back = GPT2LMHeadModel.from_pretrained(out_dir, dtype=torch.float64).eval()
    ref = dense.state_dict()
    return missing, all(torch.equal(t, ref[k]) for k, t in back.state_dict().items())


def test_hf_checkpoint_into_tp_model_and_back_out(tmp_path):
    _gpt2(seed=11).save_pretrained(tmp_path / "hf")  # HF's own safetensors: Conv1D (in, out), tied head dropped
    for missing, same in get_world(2).run(_hf_roundtrip, str(tmp_path / "hf"), str(tmp_path / "out" / "new")):
        assert missing == [] and same  # "out/new" did not exist: save_dense made it, with a config.json
    assert json.loads((tmp_path / "out" / "new" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]


def _meta_then_load(group, src_dir: str):
    """Large-model flow: build on the meta device (no weights), parallelize, allocate only this
    rank's shards, read only this rank's slices of the HF checkpoint."""
    from transformers import GPT2LMHeadModel

    dense = _gpt2(seed=11)
    with torch.device("meta"):
        model = GPT2LMHeadModel(dense.config).double().eval()
    tplayers.parallelize(model, "gpt2", group=group)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty re-creates each parameter, untying lm_head from wte: tie them again
    tplayers.load_dense(model, src_dir)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-9, atol=1e-9)
    audit = tplayers.coverage(model).audit  # parallelized on meta: audited at the first forward, once loaded
    assert all(r.status == "passed" for r in audit.regions), str(audit)
    return model.lm_head.weight is model.transformer.wte.weight


def test_meta_device_model_parallelized_then_loaded_from_hf_checkpoint(tmp_path):
    _gpt2(seed=11).save_pretrained(tmp_path / "hf")
    assert all(get_world(2).run(_meta_then_load, str(tmp_path / "hf")))


def _save_tp(group, family: str, path: str):
    model = tplayers.parallelize(BUILD[family](seed=21), family, group=group)
    tplayers.save_checkpoint(model, path)
    return True


def _load_tp(group, family: str, path: str):
    dense = BUILD[family](seed=21)
    model = tplayers.parallelize(BUILD[family](seed=22), family, group=group)
    tplayers.load_checkpoint(model, path)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    return torch.equal(model(ids).logits, model(ids).logits) and bool(
        torch.allclose(model(ids).logits, dense(ids).logits, rtol=1e-9, atol=1e-9)) and all(
        torch.equal(t, dense.state_dict()[k]) for k, t in dense_parameters(model).items())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_model_checkpoint_saved_at_tp2_loads_at_tp4(family, tmp_path):
    path = str(tmp_path / "ckpt")
    assert all(get_world(2).run(_save_tp, family, path))
    assert all(get_world(4).run(_load_tp, family, path))


def _check_sequence_parallel(group, family: str):
    dense = BUILD[family](seed=5)
    model = tplayers.parallelize(copy.deepcopy(dense), family, group=group, sequence_parallel=True)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    _assert_lm_matches(model, dense, ids)
    audit = tplayers.coverage(model).audit  # the sequence-parallel regions too: (b, s/p, h) in and out
    assert all(r.status == "passed" for r in audit.regions), str(audit)
    return True


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_shipped_plan_sequence_parallel_matches_dense(family):
    assert all(get_world(2).run(_check_sequence_parallel, family))


def _generate_sequence_parallel(group, family: str):
    """generate() feeds the prompt (7 tokens, not divisible by 2) and then one token per step: each such
    forward runs without sequence parallelism (no gradient recorded), and the tokens are the dense model's."""
    dense = BUILD[family](seed=6)
    model = tplayers.parallelize(copy.deepcopy(dense), family, group=group, sequence_parallel=True)
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=5, do_sample=False, use_cache=True, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want, got = dense.generate(prompt, **kw), model.generate(prompt, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for lt, ld in zip(got.logits, want.logits):
        torch.testing.assert_close(lt, ld, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match=r"sequence length 7 .* is not divisible by the TP degree 2; pad it to a "
                                         r"multiple of 2, or run this forward under torch.no_grad\(\)"):
        model(prompt, labels=prompt)  # training: refused, naming the length and the degree
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with tplayers.comm_accounting() as acct:
        _assert_lm_matches(model, dense, ids)  # and sequence parallelism is back on for a length that divides
    assert {"reduce_scatter", "all_gather"} <= {r.op for r in acct.records if r.phase == "forward"}
    return True


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_generate_under_sequence_parallelism_falls_back_for_lengths_that_do_not_divide(family):
    assert all(get_world(2).run(_generate_sequence_parallel, family))


def _loss_parallel(group, vocab):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                      tie_word_embeddings=False)
    dense = LlamaForCausalLM(cfg).double()
    model = tplayers.parallelize(copy.deepcopy(dense), "auto", group=group, loss_parallel=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored positions stay ignored
    out_t = model(ids, labels=labels)  # the first step (the audit, the inputs check) ...
    with tplayers.comm_accounting() as acc:  # ... and a later one, counted
        model(ids, labels=labels)
    # the dense reference in float64 (HF's own loss rounds float64 logits to float32; this one keeps float64)
    logits_d = dense(ids).logits
    loss_d = torch.nn.functional.cross_entropy(logits_d[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(out_t.loss, loss_d, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out_t.loss, dense(ids, labels=labels).loss.double(), rtol=1e-6, atol=0)  # HF's
    out_t.loss.backward()
    loss_d.backward()
    grads = dense_parameters(model, grads=True)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    gathers = [r for r in acc.records if r.op == "all_gather" and r.phase == "forward"]
    full_logits = model(ids).logits  # no labels: the whole vocabulary, gathered
    torch.testing.assert_close(full_logits, dense(ids).logits, rtol=1e-9, atol=1e-9)
    # with labels the logits stay this rank's shard, labelled as one (before: the plain shard, whose argmax
    # picked from this rank's part of the vocabulary)
    split = out_t.logits
    torch.testing.assert_close(split.full_tensor(), logits_d, rtol=1e-9, atol=1e-9)
    assert torch.equal(split.argmax(-1).full_tensor(), logits_d.argmax(-1))
    return (type(split).__name__, tuple(split.shape), tuple(split.to_local().shape)), len(gathers)


@pytest.mark.parametrize("tp,vocab", [(2, 96), (4, 98)])
def test_loss_parallel_keeps_logits_split_through_the_loss(tp, vocab):
    for shape, gathers in get_world(tp).run(_loss_parallel, vocab):
        rank_rows = shape[2][2]
        assert shape[:2] == ("DTensor", (2, 10, vocab)) and rank_rows <= -(-vocab // tp) and gathers == 0, shape


def _backward_collectives(group):
    from collections import Counter

    model = tplayers.parallelize(_llama(), "auto", group=group)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()  # the first step (audit, input checks) ...
    with tplayers.comm_accounting() as acc:  # ... then one counted
        model(ids, labels=ids).loss.backward()
    backward = [r for r in acc.records if r.phase == "backward"]
    return dict(Counter(r.op for r in backward)), sum(r.nbytes for r in backward)


def test_hugging_face_projections_on_one_input_share_their_backward_all_reduce():
    # 2 layers x (q/k/v: one, gate/up: one) + the LM head's input: 5 all-reduces of (2, 6, 32) float64
    # (separately: 11, 2.2x the bytes). Every HF test above checks the gradients against dense.
    for counts, nbytes in get_world(2).run(_backward_collectives):
        assert counts == {"all_reduce": 5} and nbytes == 5 * 2 * 6 * 32 * 8, (counts, nbytes)


def _kv_replica_collectives(group, kv_heads):
    import copy

    dense = _llama(kv_heads=kv_heads)
    model = tplayers.parallelize(copy.deepcopy(dense), "auto", group=group)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()  # the first step (audit, input checks) ...
    model.zero_grad(set_to_none=True)
    with tplayers.comm_accounting() as acc:  # ... then one counted, equal to dense
        _assert_lm_matches(model, dense, ids)
    return [(r.group_size, r.nbytes) for r in acc.records if r.phase == "backward" and r.nbytes < 2 * 6 * 32 * 8]


@pytest.mark.parametrize("tp,kv_heads,runs", [(4, 2, [(2, 2)] * 4), (3, 2, [(2, 1)] * 4)])
def test_replicated_kv_heads_sum_their_weight_gradients_over_the_ranks_sharing_them(tp, kv_heads, runs):
    # 8 heads, 2 KV heads of 4 features x hidden 32 (float64: 1024 bytes per projection, per rank): at TP 4 each
    # KV head is held by 2 ranks, at TP 3 by 2 and 1. Each layer's k_proj and v_proj weight gradients are summed
    # over the ranks sharing the head, by those ranks alone (their own group: 2 ranks, no padding), k and v
    # together: one all-reduce of 2 x 1024 bytes per layer (the rank holding its head alone sends nothing).
    # Before: one all-reduce each for k and v over the whole group, padded to a slot per KV head (2 x 1024).
    for rank, records in enumerate(get_world(tp).run(_kv_replica_collectives, kv_heads)):
        alone = runs[0][1] == 1 and rank == tp - 1
        assert records == ([] if alone else [(2, 2 * 1024)] * 2), (rank, records)


def _sequence_parallel_collectives(group):
    from collections import Counter

    model = tplayers.parallelize(_llama(), "llama", group=group, sequence_parallel=True)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    with tplayers.comm_accounting() as acc:
        model(ids, labels=ids).loss.backward()
    return dict(Counter((r.phase, r.op) for r in acc.records))


def test_sequence_parallel_siblings_share_their_gather_and_reduction():
    # The shipped "llama" SP plan, 2 layers, TP 2. Before sharing: forward 8 all-gathers; backward 9 all-gathers,
    # 12 all-reduces, 4 reduce-scatters (62720 bytes). Gate/up share one gather of their input in forward, one
    # in backward and one reduce-scatter. The attention's q/k/v and the LM head take the sequence their module
    # gathered: they keep only its shard, gather it again in backward and reduce-scatter the summed input
    # gradient (an all-reduce of the whole sequence each before): Megatron's layout, 2 gathers + 2 reduce-scatters
    # per layer each way. The 5 norms' partial weight gradients: one all-reduce (one per norm before). The
    # embedding's lookup reduce-scattered into the first layer's chunk (an all-reduce before: HF reads its shape).
    for counts in get_world(2).run(_sequence_parallel_collectives):
        assert counts == {("forward", "all_gather"): 6, ("forward", "reduce_scatter"): 5,
                          ("backward", "all_reduce"): 1, ("backward", "all_gather"): 10,
                          ("backward", "reduce_scatter"): 5}, counts


def _sp_under_autocast(group, reads_values: bool):
    """The "llama" SP plan, float32 weights, two steps under bf16 autocast on the same batch: the gathers of the
    second step (dtype of each forward all-gather) and whether its loss and gradients equal the first's bit for bit
    (the first step gathers in float32 while it watches who reads the gathered sequence)."""
    model = tplayers.parallelize(_llama().float(), "llama", group=group, sequence_parallel=True)
    logged = []
    if reads_values:  # a hook on layer 0's attention logs a statistic of its (gathered) input's values
        def log(module, args, kwargs, out):
            logged.append(kwargs["hidden_states"].detach().float().pow(2).mean())
        model.model.layers[0].self_attn.register_forward_hook(log, with_kwargs=True)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    steps = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with tplayers.comm_accounting() as acc, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
            loss.backward()
        steps.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                      [r.nbytes for r in acc.records if (r.phase, r.op) == ("forward", "all_gather")]))
    (loss1, grads1, _), (loss2, grads2, gathers) = steps
    same = bool(torch.equal(loss1, loss2)) and all(torch.equal(grads1[n], grads2[n]) for n in grads1)
    if reads_values:  # the two steps' entries, the last two (the audit's runs log before them)
        same = same and bool(torch.equal(logged[-1], logged[-2]))
    return same, gathers


def test_sequence_parallel_gathers_in_autocast_dtype_where_only_column_layers_read():
    """Each attention gathers its input (HF views q/k/v with its (b, s)); under bf16 autocast only its q/k/v read
    the values, and each casts them to bfloat16: gathering the cast shard is exact (the cast commutes with the
    gather) at half the bytes. Before: float32 gathers (forward 1.27x the budget's wire bytes). An attention that
    reads the values itself keeps its float32 gather. (6 tokens x 32 features x 2 batch: 1536 B in float32.)"""
    for same, gathers in get_world(2).run(_sp_under_autocast, False):
        # attention x2, MLP x2 in bfloat16; the head's input in float32; the bfloat16 logits (96 wide)
        assert same and sorted(gathers) == [768, 768, 768, 768, 1536, 2304], gathers
    for same, gathers in get_world(2).run(_sp_under_autocast, True):
        assert same and sorted(gathers) == [768, 768, 768, 1536, 1536, 2304], gathers  # layer 0's attention: f32
