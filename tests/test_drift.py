"""Ranks that drift after the first step: every checked collective carries a digest of what the TP ranks
must share (the model's inputs, the random generators a model with dropout draws from, its replicated
parameters, the targets of a vocabulary-parallel loss), so a rank that falls out of step is caught at the
step where it begins, on every rank, naming what differs. Before: the inputs check ran every 1000
forwards, the RNG check once, replicated parameters never, targets never; each case below trained on (or
reported one wrong loss on every rank) with no error."""
import pytest
import torch
import torch.nn as nn

import tplayers
from tplayers.core import fingerprint
from tplayers.testing import get_world


def _llama(dropout=0.0, vocab=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                      tie_word_embeddings=False, attention_dropout=dropout)
    return LlamaForCausalLM(cfg).double()


def _train(group, case, lag=False, device="cpu", **options):
    """Three SGD steps of a TP 2 Llama; at step 1 one rank drifts as ``case`` says. Returns (the step that
    raised or None, the message)."""
    rank = torch.distributed.get_rank()
    model = tplayers.parallelize(_llama(0.1 if case in ("reseed", "same") else 0.0).to(device), "auto",
                                 group=group, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fingerprint._LAG_ON_CPU[0] = lag
    try:
        for step in range(3):
            seed = step + (100 * rank if case == "batch" and step >= 1 else 0)
            ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(seed)).to(device)
            if case == "reseed" and step == 1:
                torch.manual_seed(1000 + rank)  # a per-rank reseed (seed + rank) at step 2
            if case == "seeds_without_dropout":
                torch.manual_seed(1000 + rank)  # harmless: this model draws no random numbers
            if case == "dtype" and step == 1 and rank == 1:
                ids = ids.to(torch.int32)  # the same ids, another dtype (a tokenizer's or a collate's choice)
            if case == "replica" and step == 1 and rank == 1:
                with torch.no_grad():  # as a scaler that stepped on one rank only leaves it
                    model.model.norm.weight.add_(1e-3)
            if case == "replica .data" and step == 1 and rank == 1:
                model.model.norm.weight.data.add_(1e-3)  # (through .data: its own version counter, nothing bumped)
            if case == "replica swapped" and step == 1 and rank == 1:
                model.model.norm.weight.data = model.model.norm.weight.data + 1e-3  # (new memory)
            labels = None if case == "labels" and step == 1 and rank == 1 else ids  # labels= on rank 0 only
            try:
                if case == "outside_targets":  # the loss outside the model (a pipeline schedule's loss_fn)
                    targets = ids.roll(1 + rank if step == 1 else 1, dims=1)  # rank 1's own targets at step 2
                    logits = model(ids).logits  # (b, s, V): gathered, whole on every rank
                    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
                else:
                    model(ids, labels=labels).loss.backward()
                opt.step()
                opt.zero_grad()
            except tplayers.RanksDiverged as e:
                return step, str(e)
        return None, "no error"
    finally:
        fingerprint._LAG_ON_CPU[0] = False


@pytest.fixture(scope="module", autouse=True)
def _transformers():
    pytest.importorskip("transformers")


def test_batches_that_diverge_at_step_two_are_caught_at_step_two():
    for step, message in get_world(2).run(_train, "batch"):
        assert step == 1, message
        assert "inputs of LlamaForCausalLM forward" in message and "argument 0" in message, message
        assert "rank(s) [1]" in message and "same batch" in message, message


def test_ids_of_another_dtype_on_one_rank_are_named_with_their_dtypes():
    """Before: "argument 0 differs between rank 0 and rank(s) [1]", the same values shown nothing of why (issue 53)."""
    for step, message in get_world(2).run(_train, "dtype"):
        assert step == 1, message
        assert "argument 0 differs between rank 0 and rank(s) [1] (rank 0: int64 (2, 6); rank 1: int32 (2, 6))" \
            in message, message


def test_labels_on_one_rank_only_are_named_on_every_rank():
    """Before: the rank without them read only "the ranks carry different pieces of state" (issue 53)."""
    for step, message in get_world(2).run(_train, "labels"):
        assert step == 1, message
        assert "argument 'labels' is given on rank(s) [0] only" in message, message


def test_targets_of_a_loss_outside_the_model_that_differ_at_step_two_are_caught_there():
    """Issue 57. Before: the gathered logits' gradient was compared at the first step only (then every
    check_inputs-th): each rank's vocabulary shard trained on its own rank's targets from step 2, no error."""
    for step, message in get_world(2).run(_train, "outside_targets"):
        assert step == 1, message
        assert "gradient of lm_head's output" in message and "rank(s) [1]" in message, message
        assert "same labels / targets" in message, message


def test_a_per_rank_reseed_of_a_model_with_dropout_is_caught_where_it_begins():
    for step, message in get_world(2).run(_train, "reseed"):
        assert step == 1, message
        assert "random generators" in message and "CPU generator" in message and "rank(s) [1]" in message, message
        assert "torch.manual_seed(seed)" in message, message


@pytest.mark.parametrize("case", ["replica", "replica .data", "replica swapped"])
def test_a_replicated_parameter_that_drifts_on_one_rank_is_named(case):
    """In place, through ``.data`` (which bumps no version counter) or by new memory: the forward's digest reads the
    parameters through integer views it keeps between forwards (core/digest.joint_digest), which alias them."""
    for step, message in get_world(2).run(_train, case):
        assert step == 1, message
        assert "'model.norm.weight'" in message and "rank(s) [1]" in message, message
        assert "input_layernorm" not in message, message  # only what differs is named


def test_on_a_gpu_the_drift_is_caught_one_collective_late():
    for step, message in get_world(2).run(_train, "batch", True):
        assert step == 1, message
        assert "inputs of LlamaForCausalLM forward" in message, message
        assert "checked when the group's next collective launched" in message, message


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _train_on_cuda(group, case):
    torch.cuda.set_device(0)
    return _train(group, case, device="cuda")


@cuda
@pytest.mark.parametrize("case,named", [("batch", "inputs of LlamaForCausalLM forward"),
                                        ("reseed", "CUDA generator"), ("replica", "'model.norm.weight'")])
def test_drift_of_cuda_tensors_is_caught(case, named):
    """On the GPU (two gloo ranks sharing one device) the digests are taken on the device with no
    synchronization and compared one collective late, in the step where the drift begins."""
    for step, message in get_world(2).run(_train_on_cuda, case):
        assert step == 1 and named in message and "rank(s) [1]" in message, message


@cuda
def test_cuda_ranks_in_step_train_on():
    assert get_world(2).run(_train_on_cuda, "same") == [(None, "no error")] * 2


def test_ranks_in_step_train_on():
    assert get_world(2).run(_train, "same") == [(None, "no error")] * 2
    assert get_world(2).run(_train, "seeds_without_dropout") == [(None, "no error")] * 2


def test_the_inputs_digest_follows_check_inputs():
    """check_inputs=0 turns the inputs check off, the carried digest included."""
    assert get_world(2).run(_train, "batch", False, check_inputs=0) == [(None, "no error")] * 2


def _gpt_loss(group, same):
    torch.manual_seed(0)
    config = tplayers.GPTConfig(hidden=16, n_heads=2, ffn_hidden=32, vocab_size=32, n_layers=1)
    model = tplayers.ParallelGPT(config, group=group)
    rank = torch.distributed.get_rank()
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1 if same else 1 + rank))
    try:
        return float(model.loss(ids, targets))
    except tplayers.RanksDiverged as e:
        return str(e)


def test_targets_that_differ_across_ranks_are_refused_by_the_loss():
    """Before: every rank reported the same wrong loss (the ranks' targets mixed in the sums)."""
    for message in get_world(2).run(_gpt_loss, False):
        assert isinstance(message, str), message
        assert "targets of vocab_parallel_cross_entropy" in message and "rank(s) [1]" in message, message
    losses = get_world(2).run(_gpt_loss, True)
    assert isinstance(losses[0], float) and losses[0] == losses[1]


class _Noisy(nn.Module):
    """Draws random numbers in its forward with no dropout module or config to say so."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        x = x + 0.1 * torch.rand_like(x)  # (b, s, h): the same noise on every rank, if seeded alike
        return self.down(torch.relu(self.up(x)))


def _noisy(group):
    torch.manual_seed(0)
    model = tplayers.parallelize(_Noisy().double(), {"up": "column", "down": "row"}, group=group)
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for step in range(3):
        if step == 1:
            torch.manual_seed(1000 + torch.distributed.get_rank())
        try:
            model(x).sum().backward()
        except tplayers.RanksDiverged as e:
            return step, str(e)
    return None, "no error"


def test_a_forward_that_draws_with_torch_rand_is_watched_from_its_second_step():
    """No dropout module or config: the first forward is seen moving the generators, so from the second on
    they are carried (before: the per-rank reseed gave each rank its own noise, with no error)."""
    for step, message in get_world(2).run(_noisy):
        assert step == 1, message
        assert "the random generators of _Noisy" in message and "torch.rand" in message, message


def _drift_in_the_second_tp_group(group):
    """A (dp 2, tp 2) mesh of 4 ranks: global rank 3 (rank 1 of the second TP group) gets its own batch."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tplayers.parallelize(_llama(), "auto", group=mesh)
    for step in range(2):  # each dp replica its batch; at step 2 rank 3 one of its own
        seed = 10 * step + (3 if step == 1 and dist.get_rank() == 3 else dist.get_rank() // 2)
        ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(seed))
        try:
            model(ids, labels=ids).loss.backward()
        except tplayers.RanksDiverged as e:
            return str(e), socket.gethostname()
    return None, socket.gethostname()


def test_ranks_that_diverge_are_named_by_their_global_rank_and_host():
    """Issue 57. Before: "rank(s) [1]" only, the position in the TP group, for global rank 3."""
    results = get_world(4).run(_drift_in_the_second_tp_group)
    assert [m is None for m, _ in results] == [True, True, False, False], results
    for message, host in results[2:]:
        assert "rank(s) [1]" in message and f"rank 1 = global rank 3 on {host}" in message, message
        assert f"rank 0 = global rank 2 on {host}" in message, message


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):  # (b, s, h) -> (b, s, h)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _stage_ending_in_a_row(group):
    """A pipeline stage's module (a block: norm, column, row; no head), the loss outside it (a schedule's loss_fn);
    rank 1's targets differ from step 2 on."""
    torch.manual_seed(0)
    stage = _Block().double()
    tplayers.parallelize(stage, {"fc1": "column", "fc2": "row"}, group=group)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    rank = torch.distributed.get_rank()
    for step in range(3):
        x, y = (torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step + i))
                for i in (0, 10))
        if step >= 1 and rank == 1:
            y = y + 1  # this rank's own targets
        try:
            (stage(x) - y).square().mean().backward()
            opt.step()
            opt.zero_grad()
        except tplayers.RanksDiverged as e:
            return step, str(e)
    return None, "no error"


def test_targets_of_a_stage_ending_in_a_row_layer_that_differ_are_caught_at_that_step():
    """Issue 57, on 8 ranks: a (pp, dp, tp) pipeline whose last stage ends in a row layer (no gathered head), its
    loss in the schedule's loss_fn, one TP rank given other targets: before, that step trained each shard on its own
    rank's loss with no error (the stage before got two different gradients; a step later its replicated LayerNorm
    drifted). Now the last row layer's output gradient (whole on every rank) is digested each backward."""
    for step, message in get_world(2).run(_stage_ending_in_a_row):
        assert step == 1, message
        assert "the gradient of fc2's output" in message and "rank(s) [1]" in message, message
        assert "same labels / targets" in message, message


def test_the_kept_views_digest_as_the_tensors_do_and_follow_their_memory():
    """joint_digest(views=): the per-forward digest of a model's replicated parameters reads them through integer
    views kept between forwards (no tensor op per parameter): always the digest of the tensors as they are now."""
    from tplayers.core.digest import joint_digest

    params = [torch.nn.Parameter(torch.randn(8, dtype=dtype)) for dtype in (torch.float32, torch.bfloat16) * 3]
    views: list = []
    assert int(joint_digest(params, views=views)) == int(joint_digest(params))
    kept = [id(v[1]) for v in views]
    params[1].data.add_(1.0)  # in place, through .data
    assert int(joint_digest(params, views=views)) == int(joint_digest(params)) and [id(v[1]) for v in views] == kept
    params[2].data = torch.randn(8)  # new memory: its view is made again
    assert int(joint_digest(params, views=views)) == int(joint_digest(params))
    assert [id(v[1]) for v in views][2] != kept[2] and [id(v[1]) for v in views][3] == kept[3]


def test_the_kept_views_follow_memory_freed_and_refilled_as_fsdp2_does():
    """FSDP2 frees an unsharded parameter's memory after the forward (its storage resized to 0) and fills it again
    at the next: a kept view of it must read the memory that is there now, never the freed one."""
    from tplayers.core.digest import joint_digest

    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(3)]
    views: list = []
    joint_digest(params, views=views)
    storage = params[1].untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    storage.resize_(nbytes)
    with torch.no_grad():
        params[1].copy_(torch.arange(64.0))
    assert int(joint_digest(params, views=views)) == int(joint_digest(params))
