"""Vision-language models (tiny random configs, float64): the text tower converted alone and the whole model by
"auto". A tower whose embedding is tied to a head outside it must not hand that head a vocabulary shard."""
import copy
import re

import pytest
import torch
import transformers

import tplayers
from tplayers import testing
from tplayers.layers.base import model_placements
from tplayers.testing import dense_parameters, get_world

testing.FORKSERVER_PRELOAD.extend(f"transformers.models.{f}.modeling_{f}" for f in (
    "gemma3", "paligemma", "mistral3", "llava", "idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
    "t5gemma"))

V, H = 64, 32
_VISION = dict(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1, num_attention_heads=4, image_size=16,
               patch_size=8)


def _text(config_class, **kw):
    return config_class(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, **kw).to_dict()


def _vlm(family: str, seed: int = 0):
    """A tiny VLM whose LM head (outside its text tower) is tied to the tower's token embedding (Qwen2-VL's: untied;
    T5Gemma, encoder-decoder: tied to the decoder's)."""
    T = transformers
    torch.manual_seed(seed)
    if family == "gemma3":
        config = T.Gemma3Config(text_config=_text(T.Gemma3TextConfig), vision_config=_VISION, mm_tokens_per_image=4,
                                tie_word_embeddings=True)
        model = T.Gemma3ForConditionalGeneration(config)
    elif family == "paligemma":
        config = T.PaliGemmaConfig(text_config=_text(T.GemmaConfig), vision_config=_VISION, tie_word_embeddings=True,
                                   projection_dim=H)
        model = T.PaliGemmaForConditionalGeneration(config)
    elif family == "mistral3":  # (patches not merged: four image tokens, as the others)
        config = T.Mistral3Config(text_config=_text(T.MistralConfig, tie_word_embeddings=True),
                                  vision_config={**_VISION, "head_dim": 8}, tie_word_embeddings=True,
                                  spatial_merge_size=1)
        model = T.Mistral3ForConditionalGeneration(config)
    elif family == "llava":  # (the last vision layer's features, so that every vision parameter has a gradient)
        config = T.LlavaConfig(text_config=_text(T.LlamaConfig, tie_word_embeddings=True),
                               vision_config={**_VISION, "model_type": "clip_vision_model"}, vision_feature_layer=-1,
                               tie_word_embeddings=True)
        model = T.LlavaForConditionalGeneration(config)
    elif family in ("idefics3", "smolvlm"):  # (no pixel shuffle: four image tokens)
        config_class, model_class = {"idefics3": (T.Idefics3Config, T.Idefics3ForConditionalGeneration),
                                     "smolvlm": (T.SmolVLMConfig, T.SmolVLMForConditionalGeneration)}[family]
        config = config_class(text_config=_text(T.LlamaConfig, tie_word_embeddings=True), vision_config=_VISION,
                              scale_factor=1, tie_word_embeddings=True)
        model = model_class(config)
    elif family in _QWEN:
        text_class, config_class, model_class, vision = _QWEN[family]
        text = _text(getattr(T, text_class), rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1]},
                     tie_word_embeddings=family != "qwen2_vl", bos_token_id=None, eos_token_id=None)
        config = getattr(T, config_class)(text_config=text, vision_config=vision, image_token_id=V - 1,
                                          video_token_id=V - 4, vision_start_token_id=V - 3, vision_end_token_id=V - 2,
                                          tie_word_embeddings=family != "qwen2_vl")
        model = getattr(T, model_class)(config)
    elif family == "t5gemma":  # (encoder and decoder: a token embedding each, the head tied to the decoder's)
        module = _text(T.T5GemmaModuleConfig, query_pre_attn_scalar=8, sliding_window=4)
        model = T.T5GemmaForConditionalGeneration(T.T5GemmaConfig(encoder=module, decoder=module, vocab_size=V))
    else:
        raise ValueError(family)
    assert _tied_to(model) == _TIED.get(family, _TOWERS.get(family, ("model.language_model",))[0] + ".embed_tokens")
    return model.double().eval()


# Qwen's vision towers take flattened 4 x 4 patches (one frame), each image 4 x 4 patches merged 2 x 2 into four tokens
_QWEN_VISION = dict(depth=1, hidden_size=H, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=1)
_QWEN = {"qwen2_vl": ("Qwen2VLTextConfig", "Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                      {**_QWEN_VISION, "embed_dim": H, "mlp_ratio": 2}),
         "qwen2_5_vl": ("Qwen2_5_VLTextConfig", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                        {**_QWEN_VISION, "intermediate_size": 2 * H, "out_hidden_size": H, "window_size": 8,
                         "fullatt_block_indexes": []}),  # (windows of one merged token)
         "qwen3_vl": ("Qwen3VLTextConfig", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                      {**_QWEN_VISION, "intermediate_size": 2 * H, "out_hidden_size": H, "num_position_embeddings": 16,
                       "deepstack_visual_indexes": [0]})}
# the text towers, where not model.language_model
_TOWERS = {"idefics3": ("model.text_model",), "smolvlm": ("model.text_model",),
           "t5gemma": ("model.encoder", "model.decoder")}
# the embedding the head is tied to, where not the text tower's (None: untied)
_TIED = {"qwen2_vl": None, "t5gemma": "model.decoder.embed_tokens"}


def _tied_to(model):
    """The name of the module whose weight the output head shares (None: the head's own)."""
    head = model.get_output_embeddings()
    return next((n for n, m in model.named_modules() if m is not head and getattr(m, "weight", None) is head.weight),
                None)


def _tower_alone(group, family):
    model = _vlm(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        tplayers.parallelize(model.model.language_model, "auto", group=group)
    except ValueError as e:
        untouched = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        return str(e), untouched, tuple(model.lm_head.weight.shape)
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(1))
    return None, False, tuple(model(input_ids=ids).logits.shape)


@pytest.mark.parametrize("family", ["gemma3", "paligemma", "mistral3"])
def test_a_tower_tied_to_a_head_outside_it_is_refused_naming_the_head(family):
    """Before: the tower's embedding became this rank's vocabulary shard, and so did the tied head outside it:
    logits (b, s, V/p), no error."""
    for message, untouched, head_shape in get_world(2).run(_tower_alone, family):
        assert message is not None, f"converted with no error: logits {head_shape}"
        assert "'embed_tokens.weight'" in message and "'lm_head'" in message, message
        assert "outside" in message and "parallelize(model, " in message, message
        assert untouched and head_shape == (V, H), (untouched, head_shape)


def _with_image(family: str, seed: int = 0):
    """(model, its inputs, labels): four image tokens (id V - 1) per image for the vision tower's features, then text
    ids (Qwen's: between its vision start and end tokens, marked in mm_token_type_ids for its 3-D rotary positions).
    T5Gemma's: text ids for the encoder, labels for the decoder."""
    model = _vlm(family, seed)
    g = torch.Generator().manual_seed(seed)
    if family == "t5gemma":
        return model, dict(input_ids=torch.randint(0, V, (2, 9), generator=g)), torch.randint(3, V, (2, 5), generator=g)
    for key in ("image_token_id", "image_token_index"):
        setattr(model.config, key, V - 1)
    model.config.boi_token_index, model.config.eoi_token_index = V - 3, V - 2
    if family in _QWEN:  # (2 x 16 patches of 3 x 4 x 4 pixels)
        pixels = torch.randn(2 * 16, 3 * 4 * 4, generator=g, dtype=torch.float64)
        ids = torch.cat([torch.full((2, 1), V - 3), torch.full((2, 4), V - 1), torch.full((2, 1), V - 2),
                         torch.randint(0, V - 4, (2, 5), generator=g)], 1)
        inputs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4]] * 2),
                      mm_token_type_ids=(ids == V - 1).long())
        return model, inputs, ids
    pixels = torch.randn(2, 3, 16, 16, generator=g, dtype=torch.float64)
    ids = torch.cat([torch.full((2, 4), V - 1), torch.randint(0, V - 3, (2, 5), generator=g)], 1)
    inputs = dict(input_ids=ids, pixel_values=pixels[:, None] if family in ("idefics3", "smolvlm") else pixels)
    if family == "mistral3":
        inputs["image_sizes"] = torch.tensor([[16, 16]] * 2)
    return model, inputs, ids


def _close(actual, expected, what, tol=1e-9):
    err, scale = float((actual - expected).abs().max()), float(expected.abs().max())
    assert err <= tol * scale + 1e-14, f"{what}: max error {err:.3g} vs max value {scale:.3g}"


TOL = {"gemma3": 1e-5}  # (its norms compute in float32, as in test_hf_families)


def _auto_whole(group, family):
    tol = TOL.get(family, 1e-9)
    dense, inputs, labels = _with_image(family)
    model = tplayers.parallelize(copy.deepcopy(dense), "auto", group=group)
    assert isinstance(model.get_output_embeddings(), tplayers.ParallelLMHead) and _tied_to(model) == _tied_to(dense)
    out_d, out_t = dense(**inputs, labels=labels), model(**inputs, labels=labels)
    _close(out_t.logits, out_d.logits, "logits", tol)
    _close(out_t.loss, out_d.loss, "loss", tol)
    out_d.loss.backward(), out_t.loss.backward()
    grads = dense_parameters(model, grads=True)
    for name, p in dense.named_parameters():
        if p.grad is None:  # (the vision tower's pooling head: unused)
            assert grads.get(name) is None or not grads[name].any(), name
            continue
        _close(grads[name], p.grad, f"grad of {name}", tol)
    assert tplayers.coverage(model).audit.passed, str(tplayers.coverage(model).audit)
    kw = dict(max_new_tokens=5, do_sample=False, use_cache=True, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        gen_d, gen_t = dense.generate(**inputs, **kw), model.generate(**inputs, **kw)
    assert torch.equal(gen_t.sequences, gen_d.sequences)
    for step, (lt, ld) in enumerate(zip(gen_t.logits, gen_d.logits)):
        _close(lt, ld, f"generated logits, step {step}", tol)
    report = tplayers.coverage(model)
    towers = _TOWERS.get(family, ("model.language_model",))
    placements = model_placements(model)
    text = [f"{t}.{n}" for t in towers for n, _ in dense.get_submodule(t).named_parameters() if "norm" not in n]
    unsplit = {re.sub(r"\.\d+\.", ".*.", n) for n in text if not getattr(placements.get(n), "is_sharded", False)}
    return sorted(unsplit), round(report.sharded_fraction, 3)


# The text parameters "auto" leaves whole, where not none: T5Gemma's plan names the decoder's self-attention, not its
# cross-attention. (Qwen3-VL's own plan names only its embedding: tplayers adds Qwen3's layers, test below.)
_UNSPLIT = {"t5gemma": [f"model.decoder.layers.*.cross_attn.{m}.weight" for m in ("k_proj", "o_proj", "q_proj",
                                                                                   "v_proj")]}


@pytest.mark.parametrize("family, tp", [("gemma3", 2), ("gemma3", 4), ("paligemma", 2), ("mistral3", 2), ("llava", 2),
                                        ("llava", 4), ("idefics3", 2), ("smolvlm", 2), ("qwen2_vl", 2),
                                        ("qwen2_5_vl", 4), ("qwen3_vl", 2), ("t5gemma", 2)])
def test_auto_on_a_vision_language_model_matches_dense(family, tp):
    """Before: "no tensor-parallel plan of its own" (the instance's plan, composed from the sub-configs, unread).
    The text tower and the head (tied or not) split, the vision tower whole: logits, loss, every gradient, generate.
    T5Gemma (encoder-decoder, text only): both stacks and the head split."""
    results = get_world(tp).run(_auto_whole, family)
    assert all(r == results[0] for r in results) and results[0][0] == _UNSPLIT.get(family, []), results


def test_a_thin_plan_of_a_text_tower_is_said_in_the_coverage_report(monkeypatch):
    """Issue 56: Qwen3-VL's own plan names only the text tower's embedding (and the head): without tplayers' addition
    for its tower (hf_additions: Qwen3's layers) the report says so, naming the tower; with it, and Gemma3's (attention
    and MLP too), it says nothing."""
    from tplayers.convert.plans.hf_additions import FAMILY_ADDITIONS

    T = transformers
    text = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, hidden_size=H, intermediate_size=2 * H, num_heads=4, out_hidden_size=H, patch_size=8,
                  spatial_merge_size=1, temporal_patch_size=1, deepstack_visual_indexes=[0])
    if not hasattr(T, "Qwen3VLConfig"):
        pytest.skip(f"transformers {T.__version__} has no Qwen3-VL")
    added = T.Qwen3VLForConditionalGeneration(T.Qwen3VLConfig(text_config=text, vision_config=vision))
    with pytest.warns(UserWarning, match="covers only part"):  # (its vision tower stays whole)
        tplayers.parallelize(added, "auto", group=None, audit=False)
    assert tplayers.coverage(added).notes == []
    assert type(added.model.language_model.layers[0].self_attn.q_proj).__name__ == "ColumnParallelLinear"
    monkeypatch.delitem(FAMILY_ADDITIONS, "qwen3_vl_text")
    thin = T.Qwen3VLForConditionalGeneration(T.Qwen3VLConfig(text_config=text, vision_config=vision))
    with pytest.warns(UserWarning, match="covers only part"):
        tplayers.parallelize(thin, "auto", group=None, audit=False)
    notes = tplayers.coverage(thin).notes
    assert len(notes) == 1 and notes[0].startswith("'model.language_model': the model's own plan splits") and \
        "(embed_tokens)" in notes[0], notes
    assert "thin (1):" in str(tplayers.coverage(thin))
    full = _vlm("gemma3")
    with pytest.warns(UserWarning, match="covers only part"):  # (its vision tower stays whole)
        tplayers.parallelize(full, "auto", group=None, audit=False)
    assert tplayers.coverage(full).notes == []


def _qwen3_vl_moe(group):
    """Qwen3-VL-MoE (float32: its experts' grouped GEMM takes no float64), text only: "auto" against dense."""
    T = transformers
    torch.manual_seed(0)
    text = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H, moe_intermediate_size=H, num_experts=4,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0})
    vision = dict(depth=1, hidden_size=H, intermediate_size=2 * H, num_heads=4, out_hidden_size=H, patch_size=8,
                  spatial_merge_size=1, temporal_patch_size=1, deepstack_visual_indexes=[0])
    model = T.Qwen3VLMoeForConditionalGeneration(T.Qwen3VLMoeConfig(text_config=text, vision_config=vision))
    dense = copy.deepcopy(model)
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    tplayers.parallelize(model, "auto", group=group)
    out, ref = model(input_ids=ids, labels=ids), dense(input_ids=ids, labels=ids)
    out.loss.backward(), ref.loss.backward()
    _close(out.logits, ref.logits, "logits", 1e-5)
    grads = dense_parameters(model, grads=True)
    for name, p in dense.named_parameters():
        if p.grad is not None:
            _close(grads[name], p.grad, f"grad of {name}", 1e-5)
    return tplayers.coverage(model).audit.passed


@pytest.mark.skipif(not hasattr(transformers, "Qwen3VLMoeConfig"), reason="no Qwen3-VL-MoE in this transformers")
def test_auto_on_qwen3_vl_moe_sums_its_per_head_norms_gradients():
    """Its own plan splits the attention but misses the per-head q / k norms: "auto" was refused by the audit
    (each rank's norm gradient a partial sum). tplayers' addition sums them: equal to dense, every gradient."""
    assert get_world(2).run(_qwen3_vl_moe) == [True, True]
