"""The "auto" plan's translation of Hugging Face style names, on toy models that carry a plan the
way transformers models do (``config.base_model_tp_plan``, ``_tp_plan``, ``base_model_prefix``), and
the coverage report. The real families are in test_hf_families.py."""
import copy
import re
import types
import warnings

import pytest
import torch
import torch.nn as nn

import tplayers
from tplayers.convert import HF_STYLES, SKIPPED_STYLES, Column, KVColumn, LatentKV, ReplicateReduceGrad, Row
from tplayers.convert.auto import auto_plan
from tplayers.convert.hf_styles import translate_style
from tplayers.testing import dense_parameters, get_world


def test_every_hf_style_name_translates_or_is_left_out_with_a_reason():
    assert translate_style("colwise", "m.layers.0.attn.q_proj") == Column()
    assert translate_style("colwise", "m.layers.0.attn.k_proj") == KVColumn()  # the KV-head rule
    assert translate_style("local_colwise", "m.layers.0.attn.v_proj") == KVColumn()
    assert translate_style("rowwise", "x.o_proj") == translate_style("local_rowwise", "x.o_proj") == Row()
    for gathered in ("colwise_rep", "colwise_gather_output"):
        assert translate_style(gathered, "x.qkv_proj") == Column(gather_output=True)
    for split_input in ("rowwise_rep", "rowwise_split_input"):
        assert translate_style(split_input, "x.o_proj") == Row(input_is_parallel=False)
    assert translate_style("packed_colwise", "x.gate_up_proj") == Column(parts=2)
    assert translate_style("replicated_with_grad_allreduce", "x.q_norm") == ReplicateReduceGrad()
    assert set(HF_STYLES).isdisjoint(SKIPPED_STYLES)
    assert translate_style("mla_kv_a_proj", "m.layers.0.attn.kv_a") == LatentKV()  # DeepSeek-V2/V3
    assert "local_params" in SKIPPED_STYLES  # the attention's own: its per-head parameters styled on their own keys
    with pytest.raises(ValueError, match=r"module 'm.x' has the unknown Hugging Face style 'diagonal'; known: .*colwise"):
        translate_style("diagonal", "m.x")


class _Config(types.SimpleNamespace):
    pass


class _MoEBlock(nn.Module):
    """transformers 4.5x's Llama-4 layout: a shared expert of local_colwise / local_rowwise layers and
    experts as bare parameters ("local"), summed by the "gather" style on the block."""

    def __init__(self, h: int, f: int, experts: int):
        super().__init__()
        self.shared_expert = nn.ModuleDict({"gate_proj": nn.Linear(h, f, bias=False),
                                            "up_proj": nn.Linear(h, f, bias=False),
                                            "down_proj": nn.Linear(f, h, bias=False)})
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(experts, h, 2 * f) / h ** 0.5)
        self.experts.down_proj = nn.Parameter(torch.randn(experts, f, h) / f ** 0.5)
        self.router = nn.Linear(h, experts, bias=False)

    def forward(self, x):  # (b, s, h)
        s = self.shared_expert
        shared = s["down_proj"](torch.nn.functional.silu(s["gate_proj"](x)) * s["up_proj"](x))
        weights = self.router(x).softmax(-1)  # (b, s, E): every expert, weighted (dense routing)
        gate, up = torch.einsum("bsh,ehf->bsef", x, self.experts.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("bsef,efh->bseh", torch.nn.functional.silu(gate) * up, self.experts.down_proj)
        return shared + torch.einsum("bse,bseh->bsh", weights, out)


class _Base(nn.Module):
    def __init__(self, vocab: int, h: int, f: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList([nn.ModuleDict({"feed_forward": _MoEBlock(h, f, 3)}) for _ in range(2)])


class _ToyForCausalLM(nn.Module):
    base_model_prefix = "model"
    _tp_plan = {"lm_head": "colwise_rep"}

    def __init__(self, vocab=16, h=8, f=12):
        super().__init__()
        self.config = _Config(model_type="toy", base_model_tp_plan={
            "layers.*.feed_forward.shared_expert.gate_proj": "local_colwise",
            "layers.*.feed_forward.shared_expert.up_proj": "local_colwise",
            "layers.*.feed_forward.shared_expert.down_proj": "local_rowwise",
            "layers.*.feed_forward.experts": "local",
            "layers.*.feed_forward.experts.gate_up_proj": "local_packed_rowwise",
            "layers.*.feed_forward.experts.down_proj": "local_colwise",
            "layers.*.feed_forward": "gather",
            "layers.*.self_attn.q_proj": "colwise",  # no attention here: a key that names nothing
        })
        self.model = _Base(vocab, h, f)
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, ids):  # (b, s) -> (b, s, vocab)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = x + layer["feed_forward"](x)
        return self.lm_head(x)


def _old_vocabulary_moe(group):
    torch.manual_seed(0)
    dense = _ToyForCausalLM().double()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = tplayers.parallelize(copy.deepcopy(dense), "auto", group=group)
    report = tplayers.coverage(model)
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    out_d, out_t = dense(ids), model(ids)
    torch.testing.assert_close(out_t, out_d, rtol=1e-12, atol=1e-12)
    out_d.square().sum().backward()
    out_t.square().sum().backward()
    grads = dense_parameters(model, grads=True)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    return (str(report), report.layers, report.skipped, report.unmatched,
            [str(w.message) for w in caught if "covers only part" in str(w.message)])


def test_old_moe_vocabulary_local_styles_and_gather_match_dense():
    """local_colwise / local_rowwise become plain column / row layers (whose outputs are complete), so
    the block's "gather" has nothing left to sum and is not applied; the experts stay replicated."""
    for text, layers, skipped, unmatched, warned in get_world(2).run(_old_vocabulary_moe):
        assert layers["model.layers.0.feed_forward.shared_expert.gate_proj"] == "ColumnParallelLinear"
        assert layers["model.layers.1.feed_forward.shared_expert.down_proj"] == "RowParallelLinear"
        assert layers["lm_head"] == "ParallelLMHead" and layers["model.embed_tokens"] == "VocabParallelEmbedding"
        assert "already complete" in skipped["model.layers.0.feed_forward"]
        assert "experts stay replicated" in skipped["model.layers.1.feed_forward.experts"]
        assert unmatched == ["model.layers.*.self_attn.q_proj"]
        assert warned and "model.layers.*.feed_forward.router (x2)" in text  # a linear nobody named: left dense
        assert "plan patterns that matched nothing (1):\n    model.layers.*.self_attn.q_proj" in text


def _refusals(group):
    class NoPlan(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = _Config(model_type="mystery", base_model_tp_plan=None)
            self.fc = nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"NoPlan has no tensor-parallel plan of its own .* model_type 'mystery'"):
        tplayers.parallelize(NoPlan(), "auto", group=group)
    toy = _ToyForCausalLM()
    with pytest.raises(ValueError, match=r"'auto', sequence_parallel=True\): the plan splits no attention by heads"):
        tplayers.parallelize(toy, "auto", group=group, sequence_parallel=True)
    toy.config.base_model_tp_plan["layers.*.feed_forward.router"] = "diagonal"
    with pytest.raises(ValueError, match=r"module 'model.layers.0.feed_forward.router' has the unknown Hugging Face "
                                         r"style 'diagonal'"):
        tplayers.parallelize(toy, "auto", group=group)
    assert not any(isinstance(m, tplayers.TensorParallelModule) for m in toy.modules())  # refused before any swap
    del toy.config.base_model_tp_plan["layers.*.feed_forward.router"]
    toy.model.sinks = nn.Parameter(torch.zeros(4))
    toy.config.base_model_tp_plan["sinks"] = "local_rowwise"  # a bare parameter outside the experts
    with pytest.raises(ValueError, match=r"the plan gives the bare parameter 'model.sinks' the style 'local_rowwise'"):
        tplayers.parallelize(toy, "auto", group=group)
    del toy.config.base_model_tp_plan["sinks"]
    with pytest.raises(ValueError, match=r"tplayers.coverage: _ToyForCausalLM was not parallelized"):
        tplayers.coverage(toy)
    shipped = re.escape(str(sorted(tplayers.convert.plans.PLANS)))  # ['falcon', 'gpt2', 'llama', ...]
    with pytest.raises(ValueError, match=rf"unknown plan 'lama'; shipped plans: {shipped}, or 'auto'"):
        tplayers.parallelize(toy, "lama", group=group)
    with pytest.raises(ValueError, match=r"plan 'falcon' has no sequence-parallel variant \(those with one: "
                                         r"\['gpt2', 'llama', 'opt'\]\)"):
        tplayers.parallelize(toy, "falcon", group=group, sequence_parallel=True)
    return True


def test_auto_refuses_what_it_cannot_translate_naming_it():
    assert all(get_world(2).run(_refusals))


def _custom_plan_report(group):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Linear(8, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tplayers.parallelize(model, {"0": "column", "2": "row", "9": "column"}, group=group)
    report = tplayers.coverage(model)
    return ([str(w.message) for w in caught], report.dense_layers, report.unmatched, report.sharded_params,
            report.total_params, report.replicated)


def test_coverage_of_a_custom_plan_counts_shards_and_lists_what_stayed_dense():
    for messages, dense, unmatched, sharded, total, replicated in get_world(2).run(_custom_plan_report):
        assert any("pattern(s) ['9'] matched no module" in m for m in messages)
        assert dense == ["3"] and unmatched == ["9"]
        assert sharded == 8 * 16 + 16 + 16 * 8 and total == sharded + 8 + 8 * 8 + 8  # row bias and layer 3 replicated
        assert replicated == {"2.bias": "complete gradient on every rank", "3.weight": "complete gradient on every rank",
                              "3.bias": "complete gradient on every rank"}


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)})])


class _Wrapped(nn.Module):
    """Llama 4 text's shape: base_model_prefix names a child the model does not have here."""

    base_model_prefix = "language_model"

    def __init__(self, plan):
        super().__init__()
        self.config = _Config(base_model_tp_plan=plan, model_type="toy")
        self.model = _Decoder()


def test_plan_keys_resolve_against_the_module_tree_or_are_refused_naming_the_prefix():
    auto = tplayers.convert.auto_plan(_Wrapped({"layers.*.up": "colwise", "layers.*.down": "rowwise"}))
    assert auto.plan.layers == {"model.layers.0.up": Column(), "model.layers.0.down": Row()} and not auto.unmatched
    with pytest.raises(ValueError, match=r"none of the 1 keys .* \(e.g. 'blocks.\*.fc'\) names a module, under its "
                                         r"base_model_prefix 'language_model' or under any of \['model'\]"):
        tplayers.convert.auto_plan(_Wrapped({"blocks.*.fc": "colwise"}))


class _NormedEmbedding(nn.Embedding):
    """An embedding with a forward of its own (a norm after the lookup): not a vocabulary split."""

    def forward(self, ids):
        out = super().forward(ids)
        return out / out.norm(dim=-1, keepdim=True)


def test_an_embedding_with_its_own_forward_stays_whole_and_the_report_says_why():
    """Before: "auto" made every input embedding vocab-parallel, and the style refused this one: the whole
    model refused (Inkling-2's normed embedding). Now it stays whole, the rest converts."""
    model = _ToyForCausalLM()
    model.model.embed_tokens = _NormedEmbedding(16, 8)
    auto = auto_plan(model)
    assert "model.embed_tokens" not in auto.plan.layers and "lm_head" in auto.plan.layers
    assert "_NormedEmbedding has a forward of its own" in auto.skipped["model.embed_tokens"], auto.skipped


def test_experts_named_only_by_the_expert_parallel_plan_are_split_by_ffn(monkeypatch):
    """transformers >= 5.25 names routed experts in base_model_ep_plan only: "auto" (experts="ffn") splits each
    expert's ffn with the styles 5.24's plans gave them; a layout those styles would misread stays replicated,
    named (here: Mixtral's (experts, out, in) parameters read as Aria's (experts, in, out))."""
    transformers = pytest.importorskip("transformers")
    from tplayers.convert.plans import hf_additions
    from tplayers.convert.styles_whole import Experts

    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    model = transformers.MixtralForCausalLM(config)
    if "layers.*.mlp.experts" in (config.base_model_tp_plan or {}):
        pytest.skip(f"transformers {transformers.__version__} names Mixtral's experts in its tensor-parallel plan")
    style = auto_plan(model).plan.layers["model.layers.0.mlp.experts"]
    assert isinstance(style, Experts) and sorted(style.splits) == [("down_proj", 2, 1), ("gate_up_proj", 1, 2)]
    monkeypatch.setitem(hf_additions.FFN_STYLES_BY_FAMILY, "mixtral", hf_additions.FFN_STYLES_BY_FAMILY["aria"])
    translated = auto_plan(model)
    assert "model.layers.0.mlp.experts" not in translated.plan.layers
    assert "do not fit the styles" in translated.skipped["model.layers.0.mlp.experts"]
