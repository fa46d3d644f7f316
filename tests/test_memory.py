"""Activation memory under sequence parallelism: a block saves about a TP share of the dense block's
activations, and the column linear saves only its input shard, not the gathered sequence."""
import torch

from tplayers import BlockConfig, ParallelTransformerBlock
from tplayers.core.comm import scatter_to_sequence
from tplayers.models.dense import DenseTransformerBlock
from tplayers.core.groups import resolve_group
from tplayers.testing import get_world


def _saved_activation_bytes(group, config, sequence_parallel, dense):
    """Unique non-parameter storages autograd saves in one block forward (see benchmarks/block_memory.py)."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, config.hidden)
    if dense:
        block = DenseTransformerBlock(config)
    else:
        block = ParallelTransformerBlock(config, group=group, sequence_parallel=sequence_parallel)
        x = scatter_to_sequence(x, group=group) if sequence_parallel else x
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x.detach().requires_grad_()).sum().backward()
    return sum(storages.values())


def test_sequence_parallel_saves_a_tp_share_of_activations():
    config = BlockConfig(hidden=32, n_heads=4, ffn_hidden=64, activation="swiglu", norm="rmsnorm", rotary=True)
    dense = get_world(1).run(_saved_activation_bytes, config, False, True)[0]
    for tp in (2, 4):
        per_rank = max(get_world(tp).run(_saved_activation_bytes, config, True, False))
        assert per_rank <= dense * 1.1 / tp, (tp, per_rank, dense)


def _column_sp_saved(group):
    from tplayers import ColumnParallelLinear
    g = resolve_group(group)
    layer = ColumnParallelLinear(8, 8, group=group, sequence_parallel=True)
    x = torch.randn(2, 4 // g.size, 8, requires_grad=True)  # this rank's sequence shard
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    assert out.shape == (2, 4, 8 // g.size), "the column linear all-gathers the sequence"
    acts = [t for t in saved if t.untyped_storage().data_ptr() != layer.weight.untyped_storage().data_ptr()]
    return [tuple(t.shape) for t in acts], all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                                               for t in acts)


def test_column_linear_under_sequence_parallelism_saves_only_the_input_shard():
    for shapes, is_input in get_world(2).run(_column_sp_saved):
        assert shapes == [(2, 2, 8)] and is_input  # not the gathered (2, 4, 8): re-gathered in backward
