"""A TP layer's sharded parameter read by the model's own code (a head tied by reading the embedding's weight,
as OLMo and gemma_pytorch do) is refused at the first forward, naming the parameter and the line. Before: the
logits came out vocab / p wide on each rank, with no error."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tplayers
from tplayers.testing import get_world

V, H = 16, 8


class _TiedByReading(nn.Module):
    def __init__(self, read_shape_only=False):
        super().__init__()
        self.read_shape_only = read_shape_only
        self.wte = nn.Embedding(V, H)
        self.mlp = nn.Sequential(nn.Linear(H, 2 * H), nn.ReLU(), nn.Linear(2 * H, H))

    def forward(self, ids):
        x = self.wte(ids)  # (b, s, h)
        x = x + self.mlp(x)
        if self.read_shape_only:  # metadata: not a read of the values
            assert self.wte.weight.dtype == x.dtype and self.wte.weight.shape[-1] == H
            return x
        return F.linear(x, self.wte.weight)  # (b, s, V): the head tied by reading the embedding's weight


def _run(group, read_shape_only, **options):
    torch.manual_seed(0)
    plan = {"wte": "vocab_embedding", "mlp.0": "column", "mlp.2": "row"}
    model = tplayers.parallelize(_TiedByReading(read_shape_only).double(), plan, group=group, **options)
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
    try:
        shapes = [tuple(model(ids).shape) for _ in range(2)]
    except ValueError as e:
        return str(e)
    return shapes


def test_a_head_tied_by_reading_the_embeddings_weight_is_refused():
    for message in get_world(2).run(_run, False):
        assert isinstance(message, str), message
        assert "read 'wte.weight' (shape (8, 8); a tensor-parallel layer's parameter, which holds this rank's shard" in message and "linear" in message, message
        assert "test_outside_reads.py" in message and "vocab / p" in message, message


def test_metadata_reads_and_the_off_switch_pass():
    assert get_world(2).run(_run, True) == [[(2, 5, H)] * 2] * 2
    assert get_world(2).run(_run, False, check_consistency=False) == [[(2, 5, V // 2)] * 2] * 2  # the fault itself


class _Sampler(nn.Module):
    """gemma_pytorch style: a head in another module, given the embedding's table (transposed)."""

    def __init__(self, table_t=None):
        super().__init__()
        self.table_t = table_t  # a view of the embedding's table made at construction (None: given per call)

    def forward(self, hidden, table_t=None):
        return hidden @ (self.table_t if table_t is None else table_t)  # (b, s, V)


class _HeadThroughAView(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.embedder = nn.Embedding(V, H)
        self.mlp = nn.Sequential(nn.Linear(H, 2 * H), nn.ReLU(), nn.Linear(2 * H, H))
        self.sampler = _Sampler(self.embedder.weight.t() if how == "made_first" else None)

    def forward(self, ids, table_t=None):
        x = self.embedder(ids)
        x = x + self.mlp(x)
        return self.sampler(x, table_t)


def _through_a_view(group, how):
    torch.manual_seed(0)
    plan = {"embedder": "vocab_embedding", "mlp.0": "column", "mlp.2": "row"}
    model = tplayers.parallelize(_HeadThroughAView(how).double(), plan, group=group)
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
    table = model.embedder.weight
    given = {"made_first": None, "passed_view": table.t(), "passed_alias": table.detach().t()}[how]
    try:
        return tuple(model(ids, given).shape)
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("how", ["made_first", "passed_view", "passed_alias"])
def test_a_view_of_a_shard_read_elsewhere_is_refused(how):
    """Before: a head reading a view of the embedding's table made outside the forward (at construction, as
    gemma_pytorch's sampler is handed one; or passed in) computed logits from the dense table as it was before
    parallelize (made_first) or vocab / p wide (passed), with no error."""
    for message in get_world(2).run(_through_a_view, how):
        assert isinstance(message, str), f"no error: logits {message}"
        assert "a view of 'embedder.weight'" in message and "this rank's shard" in message, message
        assert ("test_outside_reads.py" in message) == (how == "made_first"), message  # (passed in: the argument named)


class _ReadsItsOwnRows(nn.Module):
    """DeepSeek-V3's absorbed attention in small: the model reads the column layer's weight itself, knowing each
    rank holds its own rows (right for inference; in training the column's input-gradient sum is bypassed)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 2 * H, bias=False), nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        return self.down(F.relu(F.linear(x, self.up.weight)))  # (b, s, 2h / p) on each rank, as up(x) gives


def _declared_read(group, train, **options):
    torch.manual_seed(0)
    dense = _ReadsItsOwnRows().double()
    x = torch.randn(2, 3, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=train)
    try:
        model = tplayers.parallelize(copy.deepcopy(dense), {"up": "column", "down": "row"}, group=group, **options)
        with torch.set_grad_enabled(train):
            out = model(x)
            if train:
                out.sum().backward()
    except (ValueError, tplayers.AuditError) as e:
        return type(e).__name__, str(e)
    return "ok", float((out - dense(x)).abs().max())


def test_a_read_declared_by_design_passes_for_inference_and_the_audit_checks_training():
    """Issue 56. Before: DeepSeek-V3's absorbed attention (its own rows of wkv_b.weight, read outside the module) was
    refused with no way to say the read is meant; parallelize(..., shard_reads=[...]) declares it."""
    for kind, text in get_world(2).run(_declared_read, False):
        assert kind == "ValueError" and "read 'up.weight'" in text, text  # undeclared: refused as before
    for kind, err in get_world(2).run(_declared_read, False, shard_reads=["up.weight"]):
        assert kind == "ok" and err < 1e-12, err
    for kind, text in get_world(2).run(_declared_read, True, shard_reads=["up.weight"]):
        assert kind == "AuditError", text  # training through it: the input gradient misses the other ranks' part
    for kind, text in get_world(2).run(_declared_read, False, shard_reads=["*.wkv_b.weight"]):
        assert kind == "ValueError" and "names no split parameter" in text, text
