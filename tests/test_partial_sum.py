"""PartialSum: a vocabulary-parallel embedding's lookup left unsummed until its values are read, so a
sequence-parallel region's entry reduce-scatters it (Megatron's layout) while a Hugging Face model reads
its shape first; any other read sums it once, so no reader ever sees a partial value."""
import copy
import time

import pytest
import torch

import tplayers
from tplayers.regions.partial_sum import PartialSum
from tplayers.testing import get_world

VOCAB, DIM = 11, 4


def _lookups(group):
    g = tplayers.resolve_group(group)
    torch.manual_seed(0)
    dense = torch.nn.Embedding(VOCAB, DIM).double()
    emb = tplayers.VocabParallelEmbedding.from_dense(dense, group=group, partial_output=True)
    ids = torch.randint(0, VOCAB, (2, 3 * g.size), generator=torch.Generator().manual_seed(1))
    full = dense(ids)  # (b, s, h)
    ops = []
    with tplayers.comm_accounting() as acc:  # metadata: no collective
        out = emb(ids)
        meta = (out.shape, out.dtype, out.device, out.dim(), out.size(-1), len(out), out.requires_grad, out.ndim)
    assert isinstance(out, PartialSum) and meta == (full.shape, full.dtype, full.device, 3, DIM, 2, True, 3), meta
    ops.append([r.op for r in acc.records])
    with tplayers.comm_accounting() as acc:  # a sequence-parallel region's entry: this rank's chunk, reduce-scattered
        chunk = out.reduce_scatter()
    ops.append([r.op for r in acc.records])
    torch.testing.assert_close(chunk, full.detach().chunk(g.size, 1)[g.rank], rtol=0, atol=0)
    weights = torch.randn(full.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (chunk * weights.chunk(g.size, 1)[g.rank]).sum().backward()
    (full * weights).sum().backward()
    grad = tplayers.testing.dense_parameters(emb, grads=True)["weight"]
    torch.testing.assert_close(grad, dense.weight.grad, rtol=1e-12, atol=1e-12)
    # any other read sums it, once: a product (Gemma's scale), a sum, a custom Function; plain tensors come out
    with tplayers.comm_accounting() as acc:
        out = emb(ids)
        scaled, total = out * 2.0, out.sum(dim=-1)
        again = out.reduce_scatter()  # after a sum: a split of it, no collective
    ops.append([r.op for r in acc.records])
    assert type(scaled) is torch.Tensor and type(total) is torch.Tensor
    torch.testing.assert_close(scaled, 2.0 * full, rtol=0, atol=0)
    torch.testing.assert_close(total, full.sum(dim=-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(again, full.chunk(g.size, 1)[g.rank], rtol=0, atol=0)
    with torch.no_grad():
        assert torch.equal(torch.nn.functional.dropout(emb(ids), 0.0), full)
    # GPT-2: position embeddings (1, s, h) added, a dropout that drops nothing: still one reduce-scatter, and
    # one all-gather backward for the lookup and the positions together
    pos = torch.randn(1, 3 * g.size, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3),
                      requires_grad=True)
    emb.zero_grad(set_to_none=True)
    dense.zero_grad(set_to_none=True)
    with tplayers.comm_accounting() as acc:
        h = torch.nn.Dropout(0.1).eval()(emb(ids) + pos)
        assert isinstance(h, PartialSum) and h.shape == full.shape
        chunk = h.reduce_scatter()
        (chunk * weights.chunk(g.size, 1)[g.rank]).sum().backward()
    ops.append([(r.phase, r.op) for r in acc.records])
    pos_d = pos.detach().clone().requires_grad_()
    ((dense(ids) + pos_d) * weights).sum().backward()
    torch.testing.assert_close(chunk, (full + pos).detach().chunk(g.size, 1)[g.rank], rtol=0, atol=0)
    torch.testing.assert_close(pos.grad, pos_d.grad, rtol=1e-12, atol=1e-12)
    grad = tplayers.testing.dense_parameters(emb, grads=True)["weight"]
    torch.testing.assert_close(grad, dense.weight.grad, rtol=1e-12, atol=1e-12)
    # a dropout in training, a broadcast along the sequence: summed first, exactly
    h = emb(ids) + pos[:, :1]
    torch.testing.assert_close(h.reduce_scatter(), (full + pos[:, :1]).chunk(g.size, 1)[g.rank], rtol=0, atol=0)
    torch.manual_seed(5)
    dropped = torch.nn.functional.dropout(emb(ids), 0.5)
    assert type(dropped) is torch.Tensor
    return ops


@pytest.mark.parametrize("tp", [2, 3])
def test_partial_lookup_is_reduce_scattered_or_summed_once_when_read(tp):
    for ops in get_world(tp).run(_lookups):
        assert ops[:3] == [[], ["reduce_scatter"], ["all_reduce"]], ops
        assert ops[3] == [("forward", "reduce_scatter"), ("backward", "all_gather")], ops


def _rank_major_lookups(group):
    """Each use of a lookup the embedding made in rank-major token order (after one reduce-scattered unread) against
    the dense embedding: reduce-scattered, plus GPT-2's positions (1, s, h) or a whole (b, s, h) addend, and read."""
    g = tplayers.resolve_group(group)
    torch.manual_seed(0)
    dense = torch.nn.Embedding(VOCAB, DIM).double()
    emb = tplayers.VocabParallelEmbedding.from_dense(dense, group=group, partial_output=True)
    ids = torch.randint(0, VOCAB, (3, 2 * g.size), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(3, 2 * g.size, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    orders = []

    def check(addend_shape, read: bool) -> None:
        emb.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
        add = None if addend_shape is None else torch.randn(addend_shape, dtype=torch.float64, requires_grad=True)
        out = emb(ids)
        orders.append(out._rank_major)
        want = dense(ids)
        if add is not None:
            add_d = add.detach().clone().requires_grad_()
            out, want = out + add, want + add_d
        if read:  # any other use sums it, in the sequence's order
            got, want_used = out * 2.0, want * 2.0
            (got * weights).sum().backward()
            (want_used * weights).sum().backward()
        else:
            got, want_used = out.reduce_scatter(), want.chunk(g.size, 1)[g.rank]
            (got * weights.chunk(g.size, 1)[g.rank]).sum().backward()
            (want * weights).sum().backward()
        torch.testing.assert_close(got, want_used, rtol=0, atol=0)
        grad = tplayers.testing.dense_parameters(emb, grads=True)["weight"]
        torch.testing.assert_close(grad, dense.weight.grad, rtol=1e-12, atol=1e-12)
        if add is not None:
            torch.testing.assert_close(add.grad, add_d.grad, rtol=1e-12, atol=1e-12)

    for addend in (None, (1, 2 * g.size, DIM), (3, 2 * g.size, DIM)):
        check(addend, read=False)
        check(addend, read=False)
    check(None, read=True)
    check(None, read=False)
    return orders


@pytest.mark.parametrize("tp", [2, 3])
def test_a_lookup_made_in_rank_major_order_gives_the_dense_values_and_gradients(tp):
    """Issue 52: a lookup reduce-scattered unread makes the next one in the collective's rank-major token order (no
    reorder of the lookup forward, nor of its gradient backward); each of its uses equals the dense embedding's, and
    a read puts the next lookup back in the sequence's order."""
    for orders in get_world(tp).run(_rank_major_lookups):
        assert orders == [False, True, True, True, True, True, True, False], orders


def test_partial_output_and_sequence_parallel_are_one_or_the_other():
    with pytest.raises(ValueError, match="partial_output=True returns the unsummed"):
        tplayers.VocabParallelEmbedding(8, 4, group=None, partial_output=True, sequence_parallel=True)


def _embedding_output(group):
    """A vocabulary-parallel embedding's PartialSum output, its module named embed_tokens."""
    torch.manual_seed(0)
    dense = torch.nn.Embedding(VOCAB, DIM).double()
    emb = tplayers.VocabParallelEmbedding.from_dense(dense, group=group, partial_output=True)
    tplayers.core.sites.name_modules(torch.nn.ModuleDict({"embed_tokens": emb}))
    return emb(torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(1)))


def _read_on_rank_zero_only(group):
    """A user's code reads the embedding's output on rank 0; rank 1 reads it 4 s later (after rank 0 gave up)."""
    before = tplayers.set_collective_checks(True, timeout=2.0)
    try:
        out = _embedding_output(group)
        if torch.distributed.get_rank() != 0:
            time.sleep(4.0)
            out.abs()  # the same read as rank 0's
            return "read late"
        float(out.abs().mean())
        return "no error"
    except tplayers.CollectivesOutOfStep as e:
        return str(e)
    finally:
        tplayers.set_collective_checks(before[0], timeout=before[1])


def test_an_embedding_output_read_on_one_rank_only_is_named():
    """Before: 'waited 600 s ... all_reduce ... at (no module)': nothing said which tensor was being summed. A read
    outside the forward meets the other ranks' through the store first (core/store_barrier.py): the rank that waited
    names the read and the ranks that did not come, the one that came late is told it is alone, and no collective is
    left unpaired (the group stays usable)."""
    message, late = get_world(2).run(_read_on_rank_zero_only)
    assert "the output of embed_tokens (a PartialSum" in message and "for abs" in message, message
    assert "rank(s) [1] did not come" in message, message
    assert "rank 1 came to read the output of embed_tokens" in late and "rank 0 had stopped waiting" in late, late
    assert get_world(2).run(_sum_of_ranks) == [3, 3]  # the group still works


def _sum_of_ranks(group):
    return int(tplayers.core.blocking.all_reduce_tensor(torch.tensor([torch.distributed.get_rank() + 1]), group=group))


def _logged_on_rank_zero_only(group):
    """Issue 53: rank 0 alone logs the embedding's output outside the forward (`float(embed(ids).norm())` in the
    training loop); rank 1 goes on to its next collective, of another size (the next step)."""
    before = tplayers.set_collective_checks(True, timeout=3.0)
    try:
        out = _embedding_output(group)
        if torch.distributed.get_rank() == 0:
            float(out.norm())
        else:
            tplayers.core.blocking.all_reduce_tensor(torch.zeros(3), group=group)  # its next step's first collective
        return "no error"
    except tplayers.CollectivesOutOfStep as e:
        return str(e)
    finally:
        tplayers.set_collective_checks(before[0], timeout=before[1])


def test_an_embedding_output_read_outside_the_forward_on_one_rank_is_named_on_every_rank():
    """Before: rank 0's all-reduce paired with rank 1's smaller collective and gloo aborted rank 0 ("Received data
    size doesn't match"); rank 1 read only that a peer closed its connection."""
    from tplayers.testing import World

    with World(2) as world:  # a fresh world: rank 1's collective is left without its partner
        reader, other = world.run(_logged_on_rank_zero_only)
    assert "every rank of the TP group to read the output of embed_tokens (a PartialSum" in reader, reader
    assert "rank(s) [1] did not come" in reader and "outside the model's forward, for norm" in reader, reader
    assert "read it on every rank of the TP group" in reader, reader
    assert "rank 0 of the TP group is waiting for every rank to read the output of embed_tokens" in other, other


def _later_steps(group, family: str):
    """A converted model's first step reduce-scatters the embedding's lookup unread; its later steps look the ids
    up in rank-major order (GPT-2: with its positions added first), and its attention gathers its input in
    rank-major order where q / k / v are narrower than it. Three SGD steps against the dense model's."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    g = tplayers.resolve_group(group)
    torch.manual_seed(0)
    if family == "llama":
        dense = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB * 4, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=4)).double()
    else:
        dense = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB * 4, n_positions=32, n_embd=16, n_layer=1, n_head=4,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).double()
    model = tplayers.parallelize(copy.deepcopy(dense), "auto", group=group, sequence_parallel=True)
    emb = next(m for m in model.modules() if isinstance(m, tplayers.VocabParallelEmbedding))
    opt, opt_d = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(dense.parameters(), lr=0.1)
    orders = []
    for step in range(3):
        ids = torch.randint(0, VOCAB * 4, (3, 2 * g.size), generator=torch.Generator().manual_seed(step))
        orders.append(emb._scatter_order.rank_major)
        loss, loss_d = model(input_ids=ids, labels=ids).loss, dense(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, loss_d, rtol=1e-9, atol=1e-9)
        loss.backward()
        loss_d.backward()
        for o in (opt, opt_d):
            o.step()
            o.zero_grad()
    params = tplayers.testing.dense_parameters(model)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(params[name], p, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    return orders


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_converted_models_later_steps_look_up_in_rank_major_order_and_match_dense(family):
    pytest.importorskip("transformers")
    for orders in get_world(2).run(_later_steps, family):  # (GPT-2's first forward: the audit reads the lookup too)
        assert orders[0] is False and orders[2] is True, orders
