"""Vision-language models (tiny random configs, float64): the text tower converted alone and the whole model by
"auto". A tower whose embedding is tied to a head outside it must not hand that head a vocabulary shard."""
import copy

import pytest
import torch
import transformers

import tplayers
from tplayers import testing
from tplayers.layers.base import model_placements
from tplayers.testing import dense_parameters, get_world

testing.FORKSERVER_PRELOAD.extend(f"transformers.models.{f}.modeling_{f}" for f in ("gemma3", "paligemma", "mistral3"))

V, H = 64, 32
_VISION = dict(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1, num_attention_heads=4, image_size=16,
               patch_size=8)


def _text(config_class, **kw):
    return config_class(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, **kw).to_dict()


def _vlm(family: str, seed: int = 0):
    """A tiny VLM whose LM head (outside its text tower) is tied to the tower's token embedding."""
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
    else:
        config = T.Mistral3Config(text_config=_text(T.MistralConfig, tie_word_embeddings=True),
                                  vision_config={**_VISION, "head_dim": 8}, tie_word_embeddings=True)
        model = T.Mistral3ForConditionalGeneration(config)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    return model.double().eval()


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
    """(model, its inputs): image tokens (id V - 1) for the vision tower's features, then text ids."""
    model = _vlm(family, seed)
    for key in ("image_token_id", "image_token_index"):
        setattr(model.config, key, V - 1)
    model.config.boi_token_index, model.config.eoi_token_index = V - 3, V - 2
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(2, 3, 16, 16, generator=g, dtype=torch.float64)
    ids = torch.cat([torch.full((2, 4), V - 1), torch.randint(0, V - 3, (2, 5), generator=g)], 1)
    return model, dict(input_ids=ids, pixel_values=pixels)


def _close(actual, expected, what, tol=1e-9):
    err, scale = float((actual - expected).abs().max()), float(expected.abs().max())
    assert err <= tol * scale + 1e-14, f"{what}: max error {err:.3g} vs max value {scale:.3g}"


TOL = {"gemma3": 1e-5}  # (its norms compute in float32, as in test_hf_families)


def _auto_whole(group, family):
    tol = TOL.get(family, 1e-9)
    dense, inputs = _with_image(family)
    model = tplayers.parallelize(copy.deepcopy(dense), "auto", group=group)
    assert isinstance(model.lm_head, tplayers.ParallelLMHead) and model.lm_head.weight is \
        model.model.language_model.embed_tokens.weight
    out_d, out_t = dense(**inputs, labels=inputs["input_ids"]), model(**inputs, labels=inputs["input_ids"])
    _close(out_t.logits, out_d.logits, "logits", tol)
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
    text = [n for n, _ in dense.model.language_model.named_parameters() if "norm" not in n]
    placements = model_placements(model)
    unsplit = [n for n in text if not getattr(placements.get(f"model.language_model.{n}"), "is_sharded", False)]
    return unsplit, round(report.sharded_fraction, 3)


@pytest.mark.parametrize("family, tp", [("gemma3", 2), ("gemma3", 4), ("paligemma", 2)])
def test_auto_on_a_vision_language_model_matches_dense(family, tp):
    """Before: "no tensor-parallel plan of its own" (the instance's plan, composed from the sub-configs, unread).
    The text tower and the tied head split, the vision tower whole: logits, every gradient, generate."""
    results = get_world(tp).run(_auto_whole, family)
    assert all(r == results[0] for r in results) and results[0][0] == [], results  # the text tower split


def test_a_thin_plan_of_a_text_tower_is_said_in_the_coverage_report():
    """Issue 56: Qwen3-VL's own plan names only the text tower's embedding (and the head): the report says so,
    naming the tower; Gemma3's (attention and MLP too) says nothing."""
    T = transformers
    text = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, hidden_size=H, intermediate_size=2 * H, num_heads=4, out_hidden_size=H, patch_size=8,
                  spatial_merge_size=1, temporal_patch_size=1, deepstack_visual_indexes=[0])
    if not hasattr(T, "Qwen3VLConfig"):
        pytest.skip(f"transformers {T.__version__} has no Qwen3-VL")
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
