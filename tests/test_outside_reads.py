"""A TP layer's sharded parameter read by the model's own code (a head tied by reading the embedding's weight,
as OLMo and gemma_pytorch do) is refused at the first forward, naming the parameter and the line. Before: the
logits came out vocab / p wide on each rank, with no error."""
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
        assert "read 'wte.weight' ((8, 8): this rank's shard" in message and "linear" in message, message
        assert "test_outside_reads.py" in message and "vocab / p" in message, message


def test_metadata_reads_and_the_off_switch_pass():
    assert get_world(2).run(_run, True) == [[(2, 5, H)] * 2] * 2
    assert get_world(2).run(_run, False, check_consistency=False) == [[(2, 5, V // 2)] * 2] * 2  # the fault itself
