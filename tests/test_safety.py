"""No silent wrong answers (part of the no-silent-wrong issue): out-of-range ids and targets, integer
attention masks, ranks that disagree. Each case used to return a number (zeros, a finite loss); now it
raises on every rank. Second derivatives are in test_higher_order.py."""
import copy
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import tplayers
from tplayers.models.dense import DenseAttention
from tplayers.testing import get_world

from _helpers import MULTI_RANK

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _embedding_ids(group, bad):
    p = tplayers.resolve_group(group).size
    vocab = 8 * p + 3  # padded to 8p + p: ids vocab .. 9p-1 land on zero padding rows
    bad_id = {"first_padding_row": lambda v: v, "past_padding": lambda v: 100 * v, "negative": lambda v: -1}[bad]
    torch.manual_seed(0)  # the layer checks that every rank drew the same table
    emb = tplayers.VocabParallelEmbedding(vocab, 4, group=group)
    emb(torch.tensor([[0, vocab - 1]]))  # the edges are fine
    with pytest.raises(IndexError, match=rf"VocabParallelEmbedding\(vocab={vocab}\): index {bad_id(vocab)} is out of range"):
        emb(torch.tensor([[1, bad_id(vocab)]]))
    return True


@pytest.mark.parametrize("tp", MULTI_RANK)
@pytest.mark.parametrize("bad", ["first_padding_row", "past_padding", "negative"])
def test_embedding_refuses_out_of_range_ids_on_every_rank(tp, bad):
    assert all(get_world(tp).run(_embedding_ids, bad))


def _cross_entropy_targets(group):
    g = tplayers.resolve_group(group)
    vocab = 8 * g.size + 3
    local = (vocab + g.size - 1) // g.size
    logits = torch.randn(3, local, dtype=torch.float64)
    ok = torch.tensor([0, vocab - 1, -100])  # -100: the default ignore_index
    tplayers.vocab_parallel_cross_entropy(logits, ok, group=group, vocab_size=vocab)
    for bad in (vocab, -1):
        with pytest.raises(IndexError, match=rf"target: index {bad} is out of range: it must be in \[0, {vocab}\) "
                                             r"or ignore_index=-100"):
            tplayers.vocab_parallel_cross_entropy(logits, torch.tensor([1, bad, 2]), group=group, vocab_size=vocab)
    return True


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_cross_entropy_refuses_out_of_range_targets_on_every_rank(tp):
    assert all(get_world(tp).run(_cross_entropy_targets))


def test_integer_attention_masks_are_refused_by_tp_and_dense_attention():
    mask = torch.ones(4, 4, dtype=torch.int64)  # 0/1 ints would be added to the scores as a bias
    x = torch.randn(1, 4, 8)
    for attn in (DenseAttention(8, 2), tplayers.ParallelAttention(8, 2, group=None)):
        with pytest.raises(TypeError, match=r"attn_mask must be bool .* or floating point .*, got torch.int64"):
            attn(x, attn_mask=mask)


def _first_order_with_create_graph(group):
    torch.manual_seed(0)
    dense = nn.Linear(8, 8, dtype=torch.float64)
    tp = tplayers.ColumnParallelLinear.from_dense(dense, group=group, gather_output=True)
    x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    (g_tp,) = torch.autograd.grad(tp(x).pow(2).sum(), x, create_graph=True)
    (g_dense,) = torch.autograd.grad(dense(x).pow(2).sum(), x)
    return float((g_tp - g_dense).abs().max())


def test_first_order_create_graph_still_matches_dense():
    """create_graph=True on its own (no second backward) still gives the first-order gradient."""
    assert max(get_world(2).run(_first_order_with_create_graph)) < 1e-12


# ------------------------------------------------------------------ gradient norm and replicas


def _gpt(group, seed=0, sequence_parallel=False):
    """A 2-layer GPT with a padded vocabulary and one KV head (replicated on every rank at TP > 1)."""
    torch.manual_seed(seed)
    config = tplayers.GPTConfig(vocab_size=8 * 4 + 3, hidden=32, n_heads=4, n_kv_heads=1, ffn_hidden=64, n_layers=2,
                                activation="swiglu", norm="rmsnorm")
    dense = tplayers.models.dense.DenseGPT(config).double()
    tp = tplayers.ParallelGPT.from_dense(dense, group=group, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, config.vocab_size, (2, 8))
    dense.loss(ids, ids).backward()
    tp.loss(ids, ids).backward()
    return dense, tp


def _clip(group, norm_type):
    dense, tp = _gpt(group)
    want = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1, norm_type=norm_type)
    got = tplayers.clip_grad_norm_(tp, 0.1, norm_type=norm_type)
    clipped = tplayers.testing.dense_parameters(tp, grads=True)
    grad_err = max(float((clipped[n] - p.grad).abs().max()) for n, p in dense.named_parameters())
    return float(abs(got - want)), grad_err, float(want)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_equals_dense(tp, norm_type):
    """Each shard counted once, the replicated KV head once (not p times), replicated norms once."""
    for norm_err, grad_err, norm in get_world(tp).run(_clip, norm_type):
        assert norm > 0.1  # the clip acted
        assert norm_err < 1e-12 * max(1.0, norm) and grad_err < 1e-12


def _replicas(group, fault):
    dense, tp = _gpt(group, sequence_parallel=True)
    rank = tplayers.resolve_group(group).rank
    compared = tplayers.check_replicas(tp)
    if fault == "value" and rank == 1:
        with torch.no_grad():
            tp.blocks[0].attn_norm.weight.add_(1e-7)  # one rank's replica drifts
    elif fault == "grad" and rank == 1:
        tp.norm.weight.grad[0] += 1e-9  # a replicated gradient that was not (or wrongly) reduced
    elif fault == "kv_replica" and rank == 1:
        with torch.no_grad():
            attn = tp.blocks[1].attn
            q_rows = attn.local_heads * attn.head_dim  # then the one (shared) K head, then V
            attn.qkv.weight[q_rows + 1, 0] += 1.0  # rank 1's copy of the shared K head
    if fault == "none":
        return compared, None
    with pytest.raises(AssertionError, match="check_replicas: ") as info:
        tplayers.check_replicas(tp)
    return compared, str(info.value)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("fault", ["none", "value", "grad", "kv_replica"])
def test_check_replicas_passes_a_correct_model_and_names_a_drifted_replica(tp, fault):
    for compared, message in get_world(tp).run(_replicas, fault):
        assert compared > 0
        if fault == "none":
            assert message is None
            continue
        expected = {"value": "'blocks.0.attn_norm.weight' value differs between rank 0 and rank(s) [1]",
                    "grad": "'norm.weight' gradient differs between rank 0 and rank(s) [1]",
                    "kv_replica": "'blocks.1.attn.qkv.weight' value (part 1, a piece held by"}[fault]
        assert expected in message, message


@pytest.mark.parametrize("build, message", [
    (lambda: tplayers.ColumnParallelLinear(0, 8, group=None), "ColumnParallelLinear: in_features=0 must be positive"),
    (lambda: tplayers.ColumnParallelLinear(8, 0, group=None), "ColumnParallelLinear: out_features=0 must be positive"),
    (lambda: tplayers.RowParallelLinear(8, 0, group=None), "RowParallelLinear: out_features=0 must be positive"),
    (lambda: tplayers.RowParallelLinear(0, 8, group=None), "RowParallelLinear: in_features=0 must be positive"),
    (lambda: tplayers.FusedColumnParallelLinear(8, [8, 0], group=None), "part 1 size=0 must be positive"),
    (lambda: tplayers.FusedColumnParallelLinear(0, [8, 8], group=None), "in_features=0 must be positive"),
    (lambda: tplayers.VocabParallelEmbedding(0, 4, group=None), "num_embeddings=0 and embedding_dim=4 must be positive"),
    (lambda: tplayers.ParallelLMHead(0, 16, group=None), "ParallelLMHead: embedding_dim=0 must be positive"),
    (lambda: tplayers.ParallelMLP(0, 16, group=None), "ParallelMLP: hidden=0 must be positive"),
    (lambda: tplayers.ParallelMLP(8, 0, group=None), "ParallelMLP: ffn_hidden=0 must be positive"),
])
def test_zero_size_layers_are_refused(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()


# ------------------------------------------------------------------ ranks that disagree


def _parallelize_different_models(group, check):
    rank = tplayers.resolve_group(group).rank
    torch.manual_seed(0 if rank == 0 else 1)  # rank 1 forgot to seed like rank 0
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    if not check:  # without the model-wide check, each swapped layer still checks the dense tensors it shards
        with pytest.raises(ValueError, match=r"ColumnParallelLinear: the dense weight differs between rank 0 and rank 1"):
            tplayers.parallelize(model, {"0": "column", "2": "row"}, group=group, check_consistency=False)
        return "refused by the layer"
    with pytest.raises(ValueError, match=r"parallelize: '0.weight' differs between rank 0 and rank 1 of the TP group"):
        tplayers.parallelize(model, {"0": "column", "2": "row"}, group=group)
    assert isinstance(model[0], nn.Linear)  # refused before anything changed
    return "refused"


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_parallelize_refuses_ranks_with_different_dense_models(tp):
    assert get_world(tp).run(_parallelize_different_models, True) == ["refused"] * tp
    assert get_world(tp).run(_parallelize_different_models, False) == ["refused by the layer"] * tp


def _layers_built_under_different_seeds(group):
    torch.manual_seed(tplayers.resolve_group(group).rank)  # per-rank RNG state: every rank draws another matrix
    with pytest.raises(ValueError, match=r"RowParallelLinear: the dense weight differs between rank 0 and rank 1"):
        tplayers.RowParallelLinear(8, 4, group=group)
    torch.manual_seed(0)
    tplayers.RowParallelLinear(8, 4, group=group)  # the same seed everywhere: fine
    return True


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_layers_built_under_per_rank_rng_states_are_refused(tp):
    assert all(get_world(tp).run(_layers_built_under_different_seeds))


def _tracker_seeds(group):
    rank = tplayers.resolve_group(group).rank
    tplayers.RNGTracker(1234, group=group)  # the same seed everywhere: fine
    with pytest.raises(ValueError, match=r"RNGTracker: seed=.* rank\(s\) \[1\] .* passed a different one than rank 0"):
        tplayers.RNGTracker(1234 + (rank == 1), group=group)
    return True


@pytest.mark.parametrize("tp", MULTI_RANK)
def test_rng_tracker_refuses_per_rank_seeds(tp):
    assert all(get_world(tp).run(_tracker_seeds))


# ------------------------------------------------------------------ modules that only look known


class _ScaledEmbedding(nn.Embedding):  # e.g. Gemma's: the output is multiplied by sqrt(hidden)
    def forward(self, ids):
        return super().forward(ids) * 4.0


class _LoRALinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) + 0.5 * x.sum(-1, keepdim=True)


class _PlainSubclass(nn.Linear):  # no forward of its own: swapping it loses nothing
    pass


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.up, self.down, self.head = _ScaledEmbedding(16, 8), _LoRALinear(8, 16), _PlainSubclass(16, 8), nn.Linear(8, 16, bias=False)


@pytest.mark.parametrize("plan, message", [
    ({"emb": "vocab_embedding"}, "module 'emb' (style 'vocab_embedding'): _ScaledEmbedding is a subclass of "
                                 "nn.Embedding with its own forward and no 'embed_scale'"),
    ({"up": "column"}, "module 'up' is a test_safety._LoRALinear, a subclass of nn.Linear whose forward"),
    ({"up": "kv_column"}, "module 'up' is a test_safety._LoRALinear"),
])
def test_subclasses_with_their_own_forward_are_refused(plan, message):
    net = _Net()
    with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tplayers.parallelize(net, plan, group=None)
    assert type(net.emb) is _ScaledEmbedding and type(net.up) is _LoRALinear  # untouched


class _GemmaEmbedding(nn.Embedding):  # the form of HF's *ScaledWordEmbedding: explicitly supported
    def __init__(self, num, dim, padding_idx=None, embed_scale=1.0):
        super().__init__(num, dim, padding_idx)
        self.scalar_embed_scale = embed_scale
        self.embed_scale = nn.Buffer(torch.tensor(embed_scale), persistent=False)  # float32, as HF's

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class _AlmostScaled(_GemmaEmbedding):  # has embed_scale, but its forward adds a shift
    def forward(self, ids):
        return super().forward(ids) + 1.0


def test_scaled_embedding_with_another_forward_is_refused():
    net = nn.Sequential(_AlmostScaled(10, 4, embed_scale=2.0))
    with pytest.raises(TypeError, match=r"module '0' .*_AlmostScaled: its forward is not embedding\(ids\) \* embed_scale"):
        tplayers.parallelize(net, {"0": "vocab_embedding"}, group=None)
    with pytest.raises(TypeError, match="_AlmostScaled: its forward is not"):
        tplayers.VocabParallelEmbedding.from_dense(net[0], group=None)
    with pytest.raises(TypeError, match=r"RowParallelLinear.from_dense: _LoRALinear has its own forward"):
        tplayers.RowParallelLinear.from_dense(_LoRALinear(4, 4), group=None)


def _scaled_embedding_matches_dense(group, vocab):
    torch.manual_seed(0)
    dense = nn.Sequential(_GemmaEmbedding(vocab, 8, padding_idx=1, embed_scale=8 ** 0.5), nn.Linear(8, 12)).double()
    tp = tplayers.parallelize(copy.deepcopy(dense), {"0": "vocab_embedding", "1": "column"}, group=group)
    emb = tp[0]
    assert isinstance(emb, tplayers.VocabParallelEmbedding) and emb.embed_scale.dtype == dense[0].embed_scale.dtype
    assert "embed_scale" not in tp.state_dict()  # non-persistent, like HF's buffer
    ids = torch.randint(0, vocab, (3, 7))
    tplayers.testing.assert_matches_dense(tp, dense, ids, group=group, output_shard_dim=-1)
    back = emb.to_dense()  # the dense twin keeps the scale and equals the original module
    assert isinstance(back, tplayers.layers.vocab.ScaledEmbedding)
    assert torch.equal(back(ids), dense[0](ids))
    # meta: the buffer's value is unknown, HF's scalar_embed_scale supplies it
    with torch.device("meta"):
        meta = _GemmaEmbedding(vocab, 8, embed_scale=3.0)
    assert float(tplayers.VocabParallelEmbedding.from_dense(meta, group=group).embed_scale) == 3.0
    return True


@pytest.mark.parametrize("tp, vocab", [(1, 13), (2, 13), (4, 13), (4, 16)])
def test_scaled_embedding_is_supported_and_matches_dense(tp, vocab):
    assert all(get_world(tp).run(_scaled_embedding_matches_dense, vocab))


def test_subclasses_without_their_own_forward_are_swapped():
    net = tplayers.parallelize(_Net(), {"down": "row", "head": "vocab_head"}, group=None)
    assert isinstance(net.down, tplayers.RowParallelLinear) and isinstance(net.head, tplayers.ParallelLMHead)


# ------------------------------------------------------------------ clean exit


_EXIT_SCRIPT = """
import atexit, sys
import torch.distributed as dist
atexit.register(lambda: print("initialized after tplayers' exit hook:", dist.is_initialized()))  # runs last (LIFO)
import tplayers
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
layer = tplayers.ColumnParallelLinear(4, 4, group=dist.group.WORLD)
layer.tp_keepalive = [layer]  # a reference cycle: only a gc pass frees this layer's process group
print("ran")
"""


def test_a_script_that_leaves_its_gloo_group_alive_exits_cleanly(tmp_path):
    """Root cause of the rare exit-time abort ("terminate called without an active exception"):
    a gloo worker thread releasing its last collective during interpreter finalization. tplayers
    destroys a gloo world left alive and collects garbage at exit, before finalization, and says so
    (the group is the user's: owning its teardown silently would surprise)."""
    script = tmp_path / "leave_alive.py"
    script.write_text(_EXIT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["ran", "initialized after tplayers' exit hook: False"], proc.stdout
    assert "Call torch.distributed.destroy_process_group() before your script ends" in proc.stderr, proc.stderr
