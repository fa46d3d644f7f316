"""VocabParallelEmbedding, ParallelLMHead and vocab_parallel_cross_entropy vs dense torch."""
import warnings
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings

from conftest import examples
from _helpers import TP_SIZES
from hypothesis import strategies as st

import tplayers
import tplayers.testing
from tplayers import ParallelLMHead, VocabParallelEmbedding, vocab_parallel_cross_entropy
from tplayers.core.blocking import all_gather_tensor, gather_placed
from tplayers.core.placement import Sharded
from tplayers.core.groups import resolve_group
from tplayers.testing import RankFailed, assert_matches_dense, get_world


# ------------------------------------------------------------------ embedding


def _check_embedding(group, vocab, dim, shape, sequence_parallel, padding_idx, seed):
    g = resolve_group(group)
    torch.manual_seed(seed)
    dense = nn.Embedding(vocab, dim, padding_idx=padding_idx, dtype=torch.float64)
    tp = VocabParallelEmbedding.from_dense(dense, group=group, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, vocab, shape)
    if padding_idx is not None:
        ids[..., 0] = padding_idx
    report = assert_matches_dense(tp, dense, ids, group=group, output_shard_dim=-2 if sequence_parallel else None)
    # the table round-trips, padding stripped; the layout shards exactly what the module holds
    back = tp.to_dense()
    assert torch.equal(back.weight, dense.weight) and back.padding_idx == dense.padding_idx
    layout = tp.param_placements()["weight"]
    assert torch.equal(layout.shard(dense.weight, g.rank, g.size), tp.weight)
    locals_ = list(all_gather_tensor(tp.weight, 0, group=group).chunk(g.size))
    assert torch.equal(layout.unshard(locals_), dense.weight)
    return report.output_error


@pytest.mark.parametrize("tp", TP_SIZES)
@settings(max_examples=examples(8))
@given(
    vocab=st.integers(1, 13),
    dim=st.integers(1, 6),
    batch=st.integers(1, 3),
    seq_per_rank=st.integers(1, 3),
    sequence_parallel=st.booleans(),
    use_padding_idx=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_embedding_matches_dense(tp, vocab, dim, batch, seq_per_rank, sequence_parallel, use_padding_idx, seed):
    shape = (batch, seq_per_rank * tp)
    padding_idx = (seed % vocab) if use_padding_idx else None
    get_world(tp).run(_check_embedding, vocab, dim, shape, sequence_parallel, padding_idx, seed)


def _check_embedding_init(group, vocab, dim):
    torch.manual_seed(3)
    dense = nn.Embedding(vocab, dim, padding_idx=1)
    torch.manual_seed(3)
    tp = VocabParallelEmbedding(vocab, dim, padding_idx=1, group=group)
    assert torch.equal(tp.to_dense().weight, dense.weight)
    return tp.num_embeddings_padded


def test_embedding_init_equals_nn_embedding():
    assert get_world(4).run(_check_embedding_init, 7, 3) == [8] * 4


def test_lm_head_init_equals_nn_linear():
    torch.manual_seed(5)
    dense = nn.Linear(3, 7, bias=False)
    torch.manual_seed(5)
    assert torch.equal(ParallelLMHead(3, 7, group=None).weight, dense.weight)


def _embedding_sp_bad_seq(group):
    tp = VocabParallelEmbedding(8, 4, group=group, sequence_parallel=True)
    tp(torch.zeros(2, 3, dtype=torch.long))


def test_embedding_errors():
    with pytest.raises(TypeError, match="nn.Embedding"):
        VocabParallelEmbedding.from_dense(nn.Linear(2, 2), group=None)
    with pytest.raises(ValueError, match="max_norm"):
        VocabParallelEmbedding.from_dense(nn.Embedding(4, 2, max_norm=1.0), group=None)
    with pytest.raises(TypeError, match="integer"):
        VocabParallelEmbedding(4, 2, group=None)(torch.zeros(3))
    with pytest.raises(RankFailed, match="sequence length .* not divisible by the TP degree 2"):
        get_world(2).run(_embedding_sp_bad_seq)


def test_padded_layout_is_pure_and_inverts():
    full = torch.arange(10.0).reshape(5, 2)
    layout = Sharded.split(0, 5, 4, padded=True)  # padded to 8 rows, 2 per rank
    locals_ = [layout.shard(full, r, 4) for r in range(4)]
    assert [t.shape[0] for t in locals_] == [2, 2, 2, 2]
    assert torch.equal(locals_[2], torch.tensor([[8.0, 9.0], [0.0, 0.0]]))
    assert torch.equal(locals_[3], torch.zeros(2, 2))
    assert torch.equal(layout.unshard(locals_), full)


# ------------------------------------------------------------------ LM head


def _check_lm_head(group, vocab, dim, batch, seq, sequence_parallel, seed):
    torch.manual_seed(seed)
    dense = nn.Linear(dim, vocab, bias=False, dtype=torch.float64)
    x = torch.randn(batch, seq, dim, dtype=torch.float64)
    gathered = ParallelLMHead.from_dense(dense, group=group, gather_output=True)
    assert_matches_dense(gathered, dense, x, group=group)
    assert torch.equal(gathered.to_dense().weight, dense.weight)
    # the sharded logits under sequence parallelism: full sequence, this rank's vocabulary
    tp = ParallelLMHead.from_dense(dense, group=group, sequence_parallel=sequence_parallel)
    g = resolve_group(group)
    x_in = g.shard(x, 1) if sequence_parallel else x
    logits = tp(x_in)
    full = torch.cat(list(all_gather_tensor(logits, -1, group=group).split(tp.num_embeddings_per_rank, -1)), -1)
    torch.testing.assert_close(full[..., :vocab], dense(x))
    assert not full[..., vocab:].any(), "padding logits must be zero"




def _check_lm_head_bias(group, vocab, dim, batch, seq, sequence_parallel, seed):
    """A head with a bias: output, input gradient, weight and bias gradients equal the dense head's,
    gathered or as split logits fed to the loss; the padded bias entries are zero and stay inert."""
    g = resolve_group(group)
    torch.manual_seed(seed)
    dense = nn.Linear(dim, vocab, bias=True, dtype=torch.float64)
    x = torch.randn(batch, seq, dim, dtype=torch.float64)
    gathered = ParallelLMHead.from_dense(dense, group=group, gather_output=True)
    report = assert_matches_dense(gathered, dense, x, group=group)
    assert "bias" in dict(gathered.named_parameters()), "the bias is a parameter of the head"
    assert gathered.param_placements()["bias"] == gathered.param_placements()["weight"] == Sharded.split(
        0, vocab, g.size, padded=True)
    back = gathered.to_dense()
    assert type(back) is nn.Linear and torch.equal(back.weight, dense.weight) and torch.equal(back.bias, dense.bias)
    real = max(min(vocab - gathered.vocab_start, gathered.num_embeddings_per_rank), 0)  # real rows on this rank
    assert not gathered.bias[real:].any(), "padded bias entries must be zero"
    assert not gathered.bias.grad[real:].any() and not gathered.weight.grad[real:].any()
    assert "bias=True" in repr(gathered)

    # split logits (sequence parallel or not) -> vocab_parallel_cross_entropy(vocab_size=V)
    tp = ParallelLMHead.from_dense(dense, group=group, sequence_parallel=sequence_parallel)
    x_tp = (g.shard(x, 1) if sequence_parallel else x).clone().requires_grad_(True)
    x_d = x.clone().requires_grad_(True)
    target = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    logits = tp(x_tp)  # (b, s, V'/p)
    assert not logits[..., real:].any(), "padding logits stay zero, as without a bias"
    full = torch.cat(list(all_gather_tensor(logits, -1, group=group).split(tp.num_embeddings_per_rank, -1)), -1)
    torch.testing.assert_close(full[..., :vocab], dense(x))
    loss = vocab_parallel_cross_entropy(logits, target, group=group, vocab_size=vocab)
    dense.zero_grad()
    expected = F.cross_entropy(dense(x_d).flatten(0, 1), target.flatten())
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    want_dx = g.shard(x_d.grad, 1) if sequence_parallel else x_d.grad
    torch.testing.assert_close(x_tp.grad, want_dx)
    for name in ("weight", "bias"):
        got = gather_placed(getattr(tp, name).grad, tp.param_placements()[name], group=group)
        torch.testing.assert_close(got, getattr(dense, name).grad, msg=f"grad of {name}")
    assert not tp.bias.grad[real:].any() and not tp.weight.grad[real:].any(), "padding gradients must be zero"
    return report.param_grad_error


@pytest.mark.parametrize("tp", TP_SIZES)
@settings(max_examples=examples(6))
@given(vocab=st.integers(1, 11), dim=st.integers(1, 5), batch=st.integers(1, 2), seq_per_rank=st.integers(1, 2),
       sequence_parallel=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_lm_head_matches_dense(tp, vocab, dim, batch, seq_per_rank, sequence_parallel, bias, seed):
    check = _check_lm_head_bias if bias else _check_lm_head
    get_world(tp).run(check, vocab, dim, batch, seq_per_rank * tp, sequence_parallel, seed)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_lm_head_with_bias_uneven_vocabulary(tp):
    """A vocabulary that divides none of the TP degrees (7 over 2 and 4: padding rows on the last rank)."""
    for sp in (False, True):
        get_world(tp).run(_check_lm_head_bias, 7, 3, 2, 2 * tp, sp, tp)


def test_lm_head_bias_init_equals_nn_linear():
    torch.manual_seed(5)
    dense = nn.Linear(3, 7)
    torch.manual_seed(5)
    head = ParallelLMHead(3, 7, bias=True, group=None)
    assert torch.equal(head.weight, dense.weight) and torch.equal(head.bias, dense.bias)
    assert ParallelLMHead(3, 7, group=None).bias is None  # bias-free by default, as before


def _lm_head_bias_tools(group, seed):
    """clip_grad_norm_, dense_parameters and check_replicas see the bias through its placement."""
    torch.manual_seed(seed)
    dense = nn.Linear(3, 7, dtype=torch.float64)
    tp = ParallelLMHead.from_dense(dense, group=group, gather_output=True)
    x = torch.randn(4, 3, dtype=torch.float64)
    tp(x).square().sum().backward()
    dense(x).square().sum().backward()
    params, grads = tplayers.testing.dense_parameters(tp), tplayers.testing.dense_parameters(tp, grads=True)
    assert sorted(params) == ["bias", "weight"]
    torch.testing.assert_close(params["bias"], dense.bias)
    torch.testing.assert_close(grads["bias"], dense.bias.grad)
    tplayers.check_replicas(tp)
    norm = tplayers.clip_grad_norm_(tp, 1e-3)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(dense.parameters(), 1e-3))
    torch.testing.assert_close(tplayers.testing.dense_parameters(tp, grads=True)["bias"], dense.bias.grad)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_lm_head_bias_through_placements(tp):
    get_world(tp).run(_lm_head_bias_tools, tp)


def _save_head(group, path):
    torch.manual_seed(11)
    dense = nn.Linear(3, 7, dtype=torch.float64)
    tplayers.save_checkpoint(ParallelLMHead.from_dense(dense, group=group), path, group=group)
    return dense.weight, dense.bias


def _load_head(group, path):
    head = ParallelLMHead(3, 7, bias=True, group=group, dtype=torch.float64)  # other weights
    tplayers.load_checkpoint(head, path, group=group)
    back = head.to_dense()
    return back.weight, back.bias


@pytest.mark.parametrize("save_tp,load_tp", [(2, 4), (4, 1)])
def test_lm_head_bias_checkpoint_reshards(tmp_path, save_tp, load_tp):
    path = str(tmp_path / "head")
    weight, bias = get_world(save_tp).run(_save_head, path)[0]
    for w, b in get_world(load_tp).run(_load_head, path):
        assert torch.equal(w, weight) and torch.equal(b, bias)


# ------------------------------------------------------------------ cross-entropy


def _shard_logits(full, vocab, g):
    """Rank g.rank's shard of (..., vocab) logits padded with junk columns up to a multiple of p."""
    per_rank = -(-vocab // g.size)
    pad = per_rank * g.size - vocab
    junk = torch.full(full.shape[:-1] + (pad,), 1e4, dtype=full.dtype)  # must not leak into the loss
    return torch.cat([full, junk], -1).chunk(g.size, -1)[g.rank].clone(), per_rank


def _check_cross_entropy(group, shape, vocab, ignore_frac, smoothing, reduction, scale, dtype, seed):
    g = resolve_group(group)
    gen = torch.Generator().manual_seed(seed)
    full = (torch.randn(shape + (vocab,), generator=gen, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    target[torch.rand(shape, generator=gen) < ignore_frac] = -100
    if ignore_frac < 1 and target.numel():
        target.view(-1)[0] = int(torch.randint(0, vocab, (1,), generator=gen))  # at least one counted target

    dense_in = full.clone().requires_grad_()
    expected = F.cross_entropy(dense_in.reshape(-1, vocab), target.reshape(-1), label_smoothing=smoothing,
                               reduction=reduction)
    if reduction == "none":
        expected = expected.reshape(shape)

    shard, per_rank = _shard_logits(full, vocab, g)
    shard.requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, group=group, vocab_size=vocab, label_smoothing=smoothing,
                                        reduction=reduction)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, expected, **tol)

    grad_out = torch.randn(expected.shape, generator=gen, dtype=torch.float64).to(dtype)
    expected.backward(grad_out)
    loss.backward(grad_out)
    grads = all_gather_tensor(shard.grad, -1, group=group)
    torch.testing.assert_close(grads[..., :vocab], dense_in.grad, **tol)
    assert not grads[..., vocab:].any(), "padding columns got a gradient"
    return float(loss.detach().sum())


@pytest.mark.parametrize("tp", TP_SIZES)
@settings(max_examples=examples(12))
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple),
    vocab=st.integers(1, 13),
    ignore_frac=st.sampled_from([0.0, 0.3]),
    smoothing=st.sampled_from([0.0, 0.1]),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    scale=st.sampled_from([1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_cross_entropy_matches_dense(tp, shape, vocab, ignore_frac, smoothing, reduction, scale, seed):
    losses = get_world(tp).run(_check_cross_entropy, shape, vocab, ignore_frac, smoothing, reduction, scale,
                               torch.float64, seed)
    assert len(set(losses)) == 1, f"ranks disagree on the loss: {losses}"


def test_cross_entropy_float32_large_logits_is_stable():
    # logits ~ 1e4: a naive exp overflows in float32; the max-subtracted form does not
    get_world(2).run(_check_cross_entropy, (3, 5), 11, 0.0, 0.0, "mean", 1e4, torch.float32, 0)


def _ce_all_ignored(group):
    shard = torch.zeros(3, 2, dtype=torch.float64, requires_grad=True)
    loss = vocab_parallel_cross_entropy(shard, torch.full((3,), -100), group=group, vocab_size=4)
    loss.backward()
    return bool(torch.isnan(loss)), float(shard.grad.abs().sum())


def test_cross_entropy_all_ignored_matches_torch():
    expected = F.cross_entropy(torch.zeros(3, 4), torch.full((3,), -100))
    assert torch.isnan(expected)  # torch's mean over zero targets
    assert get_world(2).run(_ce_all_ignored) == [(True, 0.0)] * 2


def test_cross_entropy_errors():
    logits = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long), group=None)
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long), group=None, reduction="avg")
    with pytest.raises(ValueError, match="vocab_size=7"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long), group=None, vocab_size=7)
    with pytest.raises(TypeError, match="integer"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3), group=None)


def _ce_without_vocab_size(group):
    # a head whose vocabulary (5) does not divide p pads it: only vocab_size= can keep the padding
    # columns out of the softmax, and the logits cannot say they carry any; so the loss warns
    shard = torch.zeros(3, 4 // resolve_group(group).size + 1, dtype=torch.float64)
    with pytest.warns(FutureWarning, match="no vocab_size given; assuming the .* columns carry no padding"):
        vocab_parallel_cross_entropy(shard, torch.tensor([0, 1, 2]), group=group)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vocab_parallel_cross_entropy(shard, torch.tensor([0, 1, 2]), group=group, vocab_size=5)
    return True


def test_cross_entropy_without_vocab_size_warns_at_tp_above_one():
    assert all(get_world(2).run(_ce_without_vocab_size))
    assert all(get_world(4).run(_ce_without_vocab_size))


class _TiedLM(nn.Module):
    def __init__(self, embed, head):
        super().__init__()
        self.embed, self.head = embed, head
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


def _check_tied(group, vocab, dim, seed):
    torch.manual_seed(seed)
    dense = _TiedLM(nn.Embedding(vocab, dim, dtype=torch.float64), nn.Linear(dim, vocab, bias=False, dtype=torch.float64))
    embed = VocabParallelEmbedding.from_dense(dense.embed, group=group)
    head = ParallelLMHead.from_dense(dense.head, group=group, gather_output=True)
    tp = _TiedLM(embed, head)
    ids = torch.randint(0, vocab, (2, 5))
    dense.zero_grad()
    out, expected = tp(ids), dense(ids)
    torch.testing.assert_close(out, expected)
    grad = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    out.backward(grad)
    expected.backward(grad)
    assert tp.head.weight is tp.embed.weight
    # the one shared gradient holds both uses: embedding lookup and output projection
    torch.testing.assert_close(tp.embed.to_dense().weight, dense.embed.weight)
    full_grad = gather_placed(tp.embed.weight.grad, tp.embed.param_placements()["weight"], group=group)
    torch.testing.assert_close(full_grad, dense.embed.weight.grad)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_tied_embedding_and_lm_head(tp):
    get_world(tp).run(_check_tied, 7, 4, tp)


def _ce_narrow_target(group, dtype):
    g = resolve_group(group)
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    target = torch.randint(0, 8, (6,), generator=gen)
    expected = F.cross_entropy(full, target)
    loss = vocab_parallel_cross_entropy(full.chunk(g.size, -1)[g.rank], target.to(dtype), group=group, vocab_size=8)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tp", [1, 2])
def test_cross_entropy_accepts_narrow_integer_targets(tp):
    # F.cross_entropy takes uint8 targets; int16/int32 ids (e.g. from a tokenizer's numpy array) work too
    for dtype in (torch.uint8, torch.int16, torch.int32):
        get_world(tp).run(_ce_narrow_target, dtype)


def _ce_bf16_reduced(group, seed):
    g = resolve_group(group)
    gen = torch.Generator().manual_seed(seed)
    full = (torch.randn(3000, 32, generator=gen) * 4).bfloat16()
    target = torch.randint(0, 32, (3000,), generator=gen)
    errors = []
    for reduction in ("mean", "sum"):
        exact = F.cross_entropy(full.double(), target, reduction=reduction)
        loss = vocab_parallel_cross_entropy(full.chunk(g.size, -1)[g.rank], target, group=group, reduction=reduction,
                                            vocab_size=32)
        assert loss.dtype == torch.bfloat16
        errors.append(float((loss.double() - exact).abs() / exact))
    return max(errors)


@pytest.mark.parametrize("tp", [1, 2])
def test_cross_entropy_bf16_reduction_is_rounded_once(tp):
    # the per-token losses are reduced in float32 and rounded to bfloat16 once: the result is the
    # exact loss of these bf16 logits within half a bf16 ulp (2**-8 relative), not a sum of rounded terms
    for seed in range(8):
        err = get_world(tp).run(_ce_bf16_reduced, seed)[0]
        assert err <= 2 ** -8, f"TP {tp}, seed {seed}: relative error {err:.2e}"
