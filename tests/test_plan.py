"""parallelize(): dict plans on plain PyTorch models match dense at TP 1, 2, 4; every error names
the module and leaves the model untouched."""
import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples

import tplayers
from tplayers.layers.fused import FusedColumnParallelLinear
from tplayers.convert import Column, Plan
from tplayers.testing import assert_matches_dense, get_world


class Block(nn.Module):
    """A pre-norm MLP with a fused gate/up projection (SwiGLU), as many models write it."""

    def __init__(self, hidden: int, ffn: int, bias: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=bias)
        self.down = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):  # (b, s, h)
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)  # (b, s, ffn[/p]) each
        return x + self.down(nn.functional.silu(gate) * up)


class Net(nn.Module):
    def __init__(self, hidden: int, ffn: int, bias: bool, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, ffn, bias) for _ in range(layers))
        self.out = nn.Linear(hidden, 12)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


PLAN = {"blocks.*.gate_up": Column(parts=2), "blocks.*.down": "row", "out": "column_gather"}


def _check_net(group, hidden, ffn, bias, seed):
    torch.manual_seed(seed)
    dense = Net(hidden, ffn, bias).double()
    tp = tplayers.parallelize(copy.deepcopy(dense), PLAN, group=group)
    assert isinstance(tp.blocks[1].gate_up, FusedColumnParallelLinear)
    x = torch.randn(2, 3, hidden, dtype=torch.float64)
    return assert_matches_dense(tp, dense, x, group=group).grad_error


@settings(max_examples=examples(6))
@given(hidden=st.sampled_from([4, 8]), ffn=st.sampled_from([4, 8, 16]), bias=st.booleans(),
       seed=st.integers(0, 2**16), tp=st.sampled_from([1, 2, 4]))
def test_dict_plan_matches_dense(hidden, ffn, bias, seed, tp):
    errs = get_world(tp).run(_check_net, hidden, ffn, bias, seed)
    assert max(errs) < 1e-9


def _expect_error(group, case):
    torch.manual_seed(0)
    model = Net(8, 6, True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = {
        "indivisible": ({"blocks.*.down": "row"}, ValueError, r"module 'blocks.0.down'.*in_features=6 is not divisible by the TP degree 4"),
        "wrong_type": ({"blocks.0.norm": "column"}, TypeError, r"module 'blocks.0.norm' is a nn.LayerNorm"),
        "unknown_style": ({"out": "colwise"}, ValueError, r"unknown style 'colwise' for pattern 'out'"),
        "unknown_plan": ("bert", ValueError, r"unknown plan 'bert'"),
        "no_match": ({"decoder.*": "row"}, ValueError, r"matched no module of Net"),
        "missing_attr": (Plan({"out": "column_gather"}, divide_attrs={"blocks.*": ("num_heads",)}),
                         AttributeError, r"module 'blocks.0' \(Block\) has no attribute 'num_heads'"),
        "kv_heads_missing": ({"blocks.*.gate_up": "kv_column"}, AttributeError,
                             r"module 'blocks.0.gate_up'.*Block has no attribute path 'config.num_key_value_heads'"),
        "divisible_missing": (Plan({"out": "column_gather"}, require_divisible={"blocks.*": ("config.heads",)}),
                              AttributeError, r"module 'blocks.0' \('blocks.\*'\): Block has no attribute path"),
        "fused_gather": ({"blocks.*.gate_up": Column(parts=2, gather_output=True)}, ValueError,
                         r"module 'blocks.0.gate_up'.*gather_output=True"),
    }
    plan, exc, pattern = kinds[case]
    with pytest.raises(exc, match=pattern):
        tplayers.parallelize(model, plan, group=group)
    after = model.state_dict()
    assert all(type(m) in (Net, Block, nn.ModuleList, nn.LayerNorm, nn.Linear) for m in model.modules())
    assert all(torch.equal(after[k], before[k]) for k in before)  # untouched
    return True


@pytest.mark.parametrize("case", ["indivisible", "wrong_type", "unknown_style", "unknown_plan", "no_match",
                                  "missing_attr", "kv_heads_missing", "divisible_missing", "fused_gather"])
def test_errors_name_the_module_and_leave_model_untouched(case):
    assert all(get_world(4).run(_expect_error, case))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8, bias=False)
        self.b = nn.Linear(4, 8, bias=False)
        self.b.weight = self.a.weight


def test_tied_parameters_swapped_together_or_refused():
    model = Tied()
    with pytest.raises(ValueError, match=r"\['a.weight', 'b.weight'\] are tied"):
        tplayers.parallelize(model, {"a": "column"}, group=None)
    tplayers.parallelize(model, {"a": "column", "b": "column"}, group=None)
    assert model.a.weight is model.b.weight


def _divide_attrs(group):
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads, self.split_size = 4, 16
            self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

    model = nn.Sequential(Attn())
    plan = Plan({"0.qkv": "fused_qkv", "0.proj": "row"}, divide_attrs={"0": ("num_heads", "split_size", "head_dim?")})
    tplayers.parallelize(model, plan, group=group)
    return model[0].num_heads, model[0].split_size, tuple(model[0].qkv.weight.shape)


def test_divide_attrs_follow_local_heads():
    assert get_world(2).run(_divide_attrs) == [(2, 8, (24, 16))] * 2


class SPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


def _parallelize_twice(group):
    model = tplayers.parallelize(Net(8, 8, True), PLAN, group=group)
    with pytest.raises(ValueError, match=r"module 'blocks.0.gate_up' is already tensor-parallel"):
        tplayers.parallelize(model, PLAN, group=group)
    sp = SPNet()
    sp_plan = {"first": "scatter_sequence", "norm": tplayers.convert.SequenceParallelNorm(gather_output=True)}
    tplayers.parallelize(sp, sp_plan, group=group)
    hooks = len(sp.first._forward_pre_hooks), len(sp.norm._forward_hooks)
    with pytest.raises(ValueError, match=r"module 'first' already has the scatter_sequence hooks"):
        tplayers.parallelize(sp, sp_plan, group=group)
    # refused before anything changed: no second scatter on 'first'
    return hooks, (len(sp.first._forward_pre_hooks), len(sp.norm._forward_hooks))


def test_parallelize_twice_is_refused_before_changing_anything():
    for before, after in get_world(2).run(_parallelize_twice):
        assert before == after and before[0] == 1  # the norm: routing hooks + the gathering hook


class _NormNet(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.enter = nn.Identity()
        self.norm = nn.LayerNorm(hidden, dtype=torch.float64)

    def forward(self, x):
        return self.norm(self.enter(x))


def _check_sp_norm_survives_param_replacement(group):
    torch.manual_seed(0)
    dense = _NormNet(6)
    with torch.no_grad():
        dense.norm.weight.normal_()
        dense.norm.bias.normal_()
    model = tplayers.parallelize(copy.deepcopy(dense), {"enter": "scatter_sequence",
                                                        "norm": tplayers.convert.SequenceParallelNorm(gather_output=True)},
                                 group=group)
    assert list(model.state_dict()) == list(dense.state_dict())
    placements = tplayers.layers.model_placements(model)
    assert placements["norm.weight"].partial_grad and placements["norm.bias"].partial_grad
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    errors = [assert_matches_dense(model, dense, x, group=group).grad_error]
    # replace the parameter objects (as to_empty or a loader does): the gradient is still summed over ranks
    model.norm.weight = nn.Parameter(model.norm.weight.detach().clone())
    model.norm.bias = nn.Parameter(model.norm.bias.detach().clone())
    errors.append(assert_matches_dense(model, dense, x, group=group).grad_error)
    # to_empty re-creates every parameter; reloading the weights must keep the reduction too
    saved = copy.deepcopy(model.state_dict())
    model.to_empty(device="cpu")
    model.load_state_dict(saved)
    assert list(model.state_dict()) == list(dense.state_dict())
    errors.append(assert_matches_dense(model, dense, x, group=group).grad_error)
    return errors


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_norm_grads_survive_parameter_replacement(tp):
    for errors in get_world(tp).run(_check_sp_norm_survives_param_replacement):
        assert max(errors) < 1e-12


def test_pattern_matching_nothing_warns():
    """A typo in one pattern of a custom plan (here the norms of a sequence-parallel plan, whose
    gradients would then silently miss the all-reduce) is reported, not ignored."""
    model = SPNet()
    with pytest.warns(UserWarning, match=r"\['nrom'\] matched no module of SPNet"):
        tplayers.parallelize(model, {"first": "column", "nrom": "sequence_parallel_norm"}, group=None)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tplayers.parallelize(SPNet(), {"first": "column", "norm": "replicate"}, group=None)


def _optimizer_built_before_parallelize(group, kind):
    """The usual order in a training script with its own model: the optimizer is built first. It holds
    the dense Parameter objects; parallelize keeps those objects (now holding this rank's shards), so
    the optimizer steps the TP model: one step equals the dense model's step. (Before: the optimizer
    stepped the orphaned dense tensors and the TP model never changed.)"""
    torch.manual_seed(1)
    dense = Net(8, 8, True).double()
    model = copy.deepcopy(dense)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01)}[kind]
    opt, dense_opt = make(model.parameters()), make(dense.parameters())
    before = [id(p) for p in model.parameters()]
    tplayers.parallelize(model, PLAN, group=group)
    kept = [id(p) for p in model.parameters()] == before
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    for _ in range(2):
        for m, o in ((model, opt), (dense, dense_opt)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    after = tplayers.testing.dense_parameters(model)
    err = max((after[n] - p).abs().max().item() for n, p in dense.named_parameters())
    return kept, err


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_an_optimizer_built_before_parallelize_steps_the_tp_model(kind):
    for kept, err in get_world(2).run(_optimizer_built_before_parallelize, kind):
        assert kept and err < 1e-12, (kept, err)


class DropNet(nn.Module):
    """A model with dropout on a replicated activation (after the row layer), as users write it."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.down(torch.relu(self.up(x))))


def _dropout_with_seeds(group, per_rank_seed):
    """Each rank seeded seed + rank (a common habit): the replicated activation gets a different
    dropout mask on each rank, silently wrong (before). At the first training forward the TP ranks'
    generators are compared: refused on every rank, naming the fix; one seed everywhere is fine, and
    evaluation (no dropout) is never refused."""
    import torch.distributed as dist
    torch.manual_seed(0)
    model = tplayers.parallelize(DropNet(), {"up": "column", "down": "row"}, group=group, audit=False)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))  # the same batch on every rank
    torch.manual_seed(1 + (dist.get_rank() if per_rank_seed else 0))
    model.eval()
    model(x)  # no dropout: no check
    model.train()
    try:
        out = model(x)
    except RuntimeError as e:
        return str(e)
    return tplayers.core.blocking.all_gather_tensor(out[None].detach(), 0, group=group).unique(dim=0).shape[0]


def test_per_rank_seeds_with_dropout_are_refused_at_the_first_training_step():
    for message in get_world(2).run(_dropout_with_seeds, True):
        assert "the TP ranks' random generators differ" in message and "torch.manual_seed(seed)" in message, message
    assert get_world(2).run(_dropout_with_seeds, False) == [1, 1]  # one seed: the same output on both ranks


class DictNet(nn.Module):
    """A model taking a dict batch and its labels, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, batch, labels=None):
        out = self.down(torch.relu(self.up(batch["x"])))
        return out if labels is None else (out - labels).square().mean()


def _different_batches(group, what):
    """TP ranks fed different batches (a distributed sampler over the TP ranks): checked by default at
    the first forward, every tensor in nested arguments and keyword arguments included (labels too);
    before, only check_same_inputs (opt-in, top-level tensors) could see it. Off: check_inputs=0."""
    import torch.distributed as dist
    torch.manual_seed(0)
    model = tplayers.parallelize(DictNet(), {"up": "column", "down": "row"}, group=group, audit=False,
                                 check_inputs=0 if what == "off" else 1000)
    x, labels = torch.zeros(2, 8), torch.zeros(2, 8)
    if what in ("x", "off"):
        x = x + dist.get_rank()
    elif what == "labels":
        labels = labels + dist.get_rank()
    try:
        model({"x": x}, labels=labels)
    except ValueError as e:
        return str(e)
    return "ran"


@pytest.mark.parametrize("what, expected", [
    ("x", "argument 0['x'] differs between rank 0 and rank 1"),
    ("labels", "argument 'labels' differs between rank 0 and rank 1"),
    ("same", "ran"),
    ("off", "ran"),
])
def test_tp_ranks_fed_different_batches_are_refused_by_default(what, expected):
    for message in get_world(2).run(_different_batches, what):
        assert expected in message, message


def _router_jitter_with_seeds(group):
    """Mixtral's router_jitter_noise draws random numbers in training: seeded seed + rank, the TP ranks route
    tokens differently (before: the audit blamed the plan, as the RNG check looked at dropout only)."""
    import torch.distributed as dist
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
                           router_jitter_noise=0.1)
    model = tplayers.parallelize(MixtralForCausalLM(config), "auto", group=group)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(1 + dist.get_rank())
    model.train()
    try:
        model(ids, labels=ids)
    except (RuntimeError, tplayers.AuditError) as e:
        return str(e)
    return ""


def test_per_rank_seeds_with_router_noise_are_refused_naming_the_seeds():
    pytest.importorskip("transformers")
    for message in get_world(2).run(_router_jitter_with_seeds):
        assert "the TP ranks' random generators differ" in message and "router noise" in message, message


class _NoRowMLP(nn.Module):
    """nanochat's MLP with its c_proj left out of the plan: c_fc's split output meets a whole nn.Linear."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(8, 32), "c_proj": nn.Linear(32, 8)})

    def forward(self, x):
        return self.mlp["c_proj"](torch.relu(self.mlp["c_fc"](x)))


def _column_without_row(group, gather):
    torch.manual_seed(0)
    style = tplayers.convert.Column(gather_output=True) if gather else "column"
    try:
        model = tplayers.parallelize(_NoRowMLP().double(), {"mlp.c_fc": style}, group=group)
        return tuple(model(torch.randn(2, 3, 8, dtype=torch.float64)).shape)
    except ValueError as e:
        return str(e)
    except RuntimeError as e:
        return f"crashed: {e}"


def test_a_column_layer_no_row_layer_follows_is_refused_at_parallelize():
    """Before: no error at parallelize, then a raw 'mat1 and mat2 shapes cannot be multiplied' inside the model."""
    for message in get_world(2).run(_column_without_row, False):
        assert message.startswith("parallelize: plan 'custom': column-parallel 'mlp.c_fc'"), message
        assert "['mlp.c_proj']" in message, message
        assert "gather_output=True" in message and "row" in message, message
    assert get_world(2).run(_column_without_row, True) == [(2, 3, 8)] * 2  # its output gathered: whole, fine


def _llama_plan_on(group, family):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "phi":
        model = transformers.PhiForCausalLM(transformers.PhiConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4))
    else:
        model = transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4,
            word_embed_proj_dim=32))
    try:
        tplayers.parallelize(model, "llama", group=group)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("family", ["phi", "opt"])
def test_a_shipped_plan_on_a_family_it_does_not_fit_names_the_family(family):
    """Before: 'mat1 and mat2 shapes cannot be multiplied' inside the model at the first forward (6 of the
    plan's 11 patterns matched nothing; q/k/v split with no row layer after them)."""
    pytest.importorskip("transformers")
    for message in get_world(2).run(_llama_plan_on, family):
        assert "plan 'llama' does not fit" in message and "patterns match no module" in message, message
        assert "'auto'" in message, message


class _Doubled(nn.Module):
    def forward(self, x):
        return 2 * x


def _sequence_shards_as_inputs(group, straight: bool):
    """PyTorch's own TP example (input_layouts=Shard(...)): each rank feeds its own chunk of the sequence to a
    sequence-parallel column layer. Before: refused by the inputs check ('every TP rank must see the same
    batch'). The chunks are sequence shards by design: accepted, and the model equals dense, for two steps (the
    second through the carried inputs digest). Chunks that reach the layer through other code (``2 * x``) cannot
    be told from a data loader's per-rank batches: refused as before, with the way out named."""
    from tplayers.convert import Row

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).double()
    if not straight:
        dense = nn.Sequential(_Doubled(), *dense)
    first = "0" if straight else "1"
    plan = {first: Column(sequence_parallel=True), str(int(first) + 2): Row(sequence_parallel=True)}
    model = tplayers.parallelize(copy.deepcopy(dense), plan, group=group)
    outcomes = []
    for step in range(2):
        x = torch.randn(2, 4 * group.size(), 16, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        try:
            report = assert_matches_dense(model, dense, x, group=group, input_shard_dims=[1], output_shard_dim=1)
            outcomes.append(max(report.output_error, report.grad_error))
        except Exception as e:  # noqa: BLE001 - the test reads the message
            outcomes.append(f"{type(e).__name__}: {e}")
    return outcomes


def test_sequence_shards_fed_by_design_are_accepted():
    for outcomes in get_world(2).run(_sequence_shards_as_inputs, True):
        assert all(isinstance(o, float) and o < 1e-12 for o in outcomes), outcomes
    for outcomes in get_world(2).run(_sequence_shards_as_inputs, False):
        assert outcomes[0].startswith("ValueError: check_same_inputs"), outcomes  # (not relabelled by the audit)
        assert "every TP rank must see the same batch" in outcomes[0], outcomes
        assert "straight to the sequence-parallel layer" in outcomes[0], outcomes


class Linear(nn.Module):
    """A library's own Linear (not torch's): a weight and its own forward, which is not a plain linear (a Linear in
    all but name, gemma_pytorch's, is split: test_own_plans.py)."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i))

    def forward(self, x):
        return torch.tanh(x @ self.weight.t())


def test_a_library_s_own_linear_is_named_with_its_module():
    """Before: "module 'fc' is a Linear; style 'column' needs an nn.Linear", which reads as a contradiction."""
    model = nn.Sequential()
    model.add_module("fc", Linear(4, 8))
    with pytest.raises(TypeError, match=r"module 'fc' is a test_plan\.Linear; style 'column' needs an nn\.Linear"):
        tplayers.parallelize(model, {"fc": "column"}, group=None)
