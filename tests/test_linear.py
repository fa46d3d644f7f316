"""ColumnParallelLinear and RowParallelLinear against float64 dense nn.Linear references."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from conftest import examples
from _helpers import F64, TP_SIZES

import tplayers
from tplayers import ColumnParallelLinear, RowParallelLinear
from tplayers.testing import assert_matches_dense, get_world


def _dense_linear(seed, in_features, out_features, bias):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias, dtype=F64)


def _input(seed, lead, features):
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(tuple(lead) + (features,), generator=gen, dtype=F64)


# ------------------------------------------------------------------ per-rank checks


def _check_column(group, seed, lead, in_f, out_f, bias, gather_output, overlap):
    dense = _dense_linear(seed, in_f, out_f, bias)
    tp = ColumnParallelLinear.from_dense(dense, group=group, gather_output=gather_output, overlap_comm=overlap)
    report = assert_matches_dense(tp, dense, _input(seed, lead, in_f), group=group,
                                  output_shard_dim=None if gather_output else -1)
    return report.output_error, report.grad_error


def _check_row(group, seed, lead, in_f, out_f, bias, input_is_parallel, overlap):
    dense = _dense_linear(seed, in_f, out_f, bias)
    tp = RowParallelLinear.from_dense(dense, group=group, input_is_parallel=input_is_parallel, overlap_comm=overlap)
    report = assert_matches_dense(tp, dense, _input(seed, lead, in_f), group=group,
                                  input_shard_dims=[-1] if input_is_parallel else None)
    return report.output_error, report.grad_error


class DenseMLP(nn.Module):
    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TPMLP(nn.Module):
    """Column -> GELU -> Row, the Megatron MLP, built from the dense one."""

    def __init__(self, dense: DenseMLP, group, sequence_parallel=False, overlap=True):
        super().__init__()
        self.fc1 = ColumnParallelLinear.from_dense(dense.fc1, group=group, sequence_parallel=sequence_parallel,
                                                   overlap_comm=overlap)
        self.fc2 = RowParallelLinear.from_dense(dense.fc2, group=group, sequence_parallel=sequence_parallel,
                                                overlap_comm=overlap)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _check_linear_pair_mlp(group, seed, lead, hidden, ffn, bias, sequence_parallel, overlap):
    torch.manual_seed(seed)
    dense = DenseMLP(nn.Linear(hidden, ffn, bias=bias, dtype=F64), nn.Linear(ffn, hidden, bias=bias, dtype=F64))
    tp = TPMLP(dense, group, sequence_parallel, overlap)
    sp = [-2] if sequence_parallel else None
    report = assert_matches_dense(tp, dense, _input(seed, lead, hidden), group=group,
                                  input_shard_dims=sp, output_shard_dim=-2 if sequence_parallel else None)
    return report.output_error, report.grad_error


def _check_overlap_is_bit_identical(group, seed, sequence_parallel):
    """overlap_comm only changes when we wait, never what is computed."""
    torch.manual_seed(seed)
    dense = DenseMLP(nn.Linear(8, 16, dtype=torch.float32), nn.Linear(16, 8, dtype=torch.float32))
    x = torch.randn(2, 4, 8)
    if sequence_parallel:
        x = x.chunk(group.size(), dim=-2)[group.rank()]
    results = []
    for overlap in (True, False):
        tp = TPMLP(dense, group, sequence_parallel, overlap)
        xi = x.clone().requires_grad_()
        out = tp(xi)
        out.pow(2).sum().backward()
        results.append([out, xi.grad] + [p.grad for p in tp.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*results))


# ------------------------------------------------------------------ property tests

leads = st.lists(st.integers(1, 3), min_size=0, max_size=2)


@pytest.mark.parametrize("tp", TP_SIZES)
@settings(max_examples=examples(8))
@given(seed=st.integers(0, 2**16), lead=leads, in_f=st.integers(1, 9), out_mult=st.integers(1, 3),
       bias=st.booleans(), gather_output=st.booleans(), overlap=st.booleans())
def test_column_parallel_matches_dense(tp, seed, lead, in_f, out_mult, bias, gather_output, overlap):
    get_world(tp).run(_check_column, seed, lead, in_f, 4 * out_mult, bias, gather_output, overlap)


@pytest.mark.parametrize("tp", TP_SIZES)
@settings(max_examples=examples(8))
@given(seed=st.integers(0, 2**16), lead=leads, in_mult=st.integers(1, 3), out_f=st.integers(1, 9),
       bias=st.booleans(), input_is_parallel=st.booleans(), overlap=st.booleans())
def test_row_parallel_matches_dense(tp, seed, lead, in_mult, out_f, bias, input_is_parallel, overlap):
    get_world(tp).run(_check_row, seed, lead, 4 * in_mult, out_f, bias, input_is_parallel, overlap)


@pytest.mark.parametrize("tp", TP_SIZES)
@settings(max_examples=examples(6))
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 2), seq_mult=st.integers(1, 2),
       hidden_mult=st.integers(1, 3), ffn_mult=st.integers(1, 3), bias=st.booleans(),
       sequence_parallel=st.booleans(), overlap=st.booleans())
def test_column_gelu_row_mlp_matches_dense(tp, seed, batch, seq_mult, hidden_mult, ffn_mult, bias,
                                           sequence_parallel, overlap):
    lead = [batch, 4 * seq_mult]
    get_world(tp).run(_check_linear_pair_mlp, seed, lead, 4 * hidden_mult, 4 * ffn_mult, bias, sequence_parallel,
                      overlap)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_overlap_on_and_off_are_bit_identical(tp, sequence_parallel):
    assert all(get_world(tp).run(_check_overlap_is_bit_identical, 3, sequence_parallel))


# ------------------------------------------------------------------ init, conversion, repr


def _check_init_equals_dense_shards(group, seed):
    rank, size = group.rank(), group.size()
    torch.manual_seed(seed)
    dense = nn.Linear(8, 12)
    torch.manual_seed(seed)
    col = ColumnParallelLinear(8, 12, group=group)
    torch.manual_seed(seed)
    row = RowParallelLinear(12, 8, group=group)
    torch.manual_seed(seed)
    dense_row = nn.Linear(12, 8)
    assert torch.equal(col.weight, dense.weight.chunk(size, 0)[rank])
    assert torch.equal(col.bias, dense.bias.chunk(size, 0)[rank])
    assert torch.equal(row.weight, dense_row.weight.chunk(size, 1)[rank])
    assert torch.equal(row.bias, dense_row.bias)
    return True


@pytest.mark.parametrize("tp", TP_SIZES)
def test_init_equals_dense_init_shards(tp):
    assert all(get_world(tp).run(_check_init_equals_dense_shards, 11))


def _check_round_trip(group):
    torch.manual_seed(0)
    a, b = nn.Linear(6, 8, dtype=F64), nn.Linear(8, 6, bias=False, dtype=F64)
    a.weight.requires_grad_(False)
    col = ColumnParallelLinear.from_dense(a, group=group)
    row = RowParallelLinear.from_dense(b, group=group)
    assert not col.weight.requires_grad, "from_dense must keep requires_grad"
    back_a, back_b = col.to_dense(), row.to_dense()
    assert type(back_a) is nn.Linear and type(back_b) is nn.Linear
    assert torch.equal(back_a.weight, a.weight) and torch.equal(back_a.bias, a.bias)
    assert torch.equal(back_b.weight, b.weight) and back_b.bias is None
    assert back_a.weight.dtype == F64 and not back_a.weight.requires_grad
    # from_dense copies: training the TP layer leaves the dense module untouched
    with torch.no_grad():
        row.weight.add_(1.0)
    assert not torch.equal(row.to_dense().weight, b.weight)
    return repr(col), repr(row)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_from_dense_to_dense_round_trip(tp):
    col_repr, row_repr = get_world(tp).run(_check_round_trip)[0]
    assert f"tp_size={tp}" in col_repr and "out_features_per_rank" in col_repr
    assert f"tp_size={tp}" in row_repr and "in_features_per_rank" in row_repr


def test_world_of_one_without_process_group_is_nn_linear():
    torch.manual_seed(0)
    dense = nn.Linear(5, 7)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(5, 7, group=None)
    row = RowParallelLinear.from_dense(dense, group=None)
    x = torch.randn(3, 5)
    assert torch.equal(layer(x), dense(x)) and torch.equal(row(x), dense(x))
    assert isinstance(layer.to_dense(), nn.Linear)


def test_autocast_bf16_on_cpu():
    torch.manual_seed(0)
    dense = nn.Linear(16, 16)
    col = ColumnParallelLinear.from_dense(dense, group=None)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = col(x), dense(x)
    assert out.dtype == torch.bfloat16 == ref.dtype
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert col.weight.grad is not None and col.weight.grad.dtype == torch.float32


# ------------------------------------------------------------------ bad input


def _check_bad_inputs(group):
    size = group.size()
    bad = 2 * size + 1
    with pytest.raises(ValueError, match=rf"ColumnParallelLinear: out_features={bad} is not divisible by the TP degree {size}"):
        ColumnParallelLinear(4, bad, group=group)
    with pytest.raises(ValueError, match=rf"RowParallelLinear: in_features={bad} is not divisible by the TP degree {size}"):
        RowParallelLinear(bad, 4, group=group)
    col = ColumnParallelLinear(8, 8, group=group)
    with pytest.raises(ValueError, match=r"input's last dim is 7 .* expected 8"):
        col(torch.randn(2, 7))
    with pytest.raises(TypeError, match="input dtype torch.float64 does not match the weight dtype torch.float32"):
        col(torch.randn(2, 8, dtype=F64))
    row = RowParallelLinear(8, 8, group=group)
    with pytest.raises(ValueError, match=rf"expected {8 // size}"):
        row(torch.randn(2, 8 if size > 1 else 7))
    meta = ColumnParallelLinear(8, 8, group=group, device="meta")
    with pytest.raises(ValueError, match="input is on cpu but the weight is on meta"):
        meta(torch.randn(2, 8))
    sp_row = RowParallelLinear(8, 8, group=group, sequence_parallel=True)
    with pytest.raises(ValueError, match=rf"sequence length 3 is not divisible by the TP degree {size}"):
        sp_row(torch.randn(2, 3, 8 // size))
    with pytest.raises(ValueError, match="gather_output=True cannot be combined with sequence_parallel"):
        ColumnParallelLinear(8, 8, group=group, gather_output=True, sequence_parallel=True)
    with pytest.raises(TypeError, match="from_dense expects an nn.Linear"):
        ColumnParallelLinear.from_dense(nn.Embedding(4, 4), group=group)
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        ColumnParallelLinear(8, 8, group=2)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_bad_inputs_raise_clear_errors(tp):
    assert all(get_world(tp).run(_check_bad_inputs))


def test_process_group_without_init_is_a_clear_error(monkeypatch):
    import torch.distributed as dist
    assert not dist.is_initialized()
    fake_pg = dist.ProcessGroup(dist.HashStore(), 0, 1)  # a group object, but no init_process_group
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ColumnParallelLinear(4, 4, group=fake_pg)


# ------------------------------------------------------------------ groups and meshes


def _check_mesh_groups(group):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    rank = dist.get_rank()
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_from_mesh = tplayers.resolve_group(mesh2d)  # the named "tp" dim
    assert (tp_from_mesh.rank, tp_from_mesh.size) == (rank % 2, 2)
    assert tplayers.resolve_group(mesh2d["tp"]).size == 2
    with pytest.raises(ValueError, match="dimension named 'tp'"):
        tplayers.resolve_group(init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")))
    # a layer on the mesh matches dense, independently in each dp replica
    torch.manual_seed(0)
    dense = nn.Linear(4, 8, dtype=F64)
    col = ColumnParallelLinear.from_dense(dense, group=mesh2d, gather_output=True)
    assert_matches_dense(col, dense, torch.randn(3, 4, dtype=F64), group=mesh2d)
    # a group this rank is not in
    other = dist.new_group([0, 1])
    if rank >= 2:
        with pytest.raises(ValueError, match="is not a member of the TP group"):
            ColumnParallelLinear(4, 8, group=other)
    return True


def test_device_mesh_and_group_membership():
    assert all(get_world(4).run(_check_mesh_groups))


# ------------------------------------------------------------------ CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _check_linear_pair_mlp_on_cuda(group, seed):
    torch.cuda.set_device(0)
    torch.manual_seed(seed)
    dense = DenseMLP(nn.Linear(16, 32, dtype=F64), nn.Linear(32, 16, dtype=F64)).cuda()
    tp = TPMLP(dense, group)
    x = torch.randn(2, 4, 16, dtype=F64, device="cuda")
    report = assert_matches_dense(tp, dense, x, group=group)
    return report.output_error, report.grad_error


@cuda
def test_cuda_nccl_world_of_one():
    get_world(1, backend="nccl").run(_check_linear_pair_mlp_on_cuda, 0)


@cuda
def test_cuda_tensors_over_gloo_two_ranks():
    get_world(2).run(_check_linear_pair_mlp_on_cuda, 0)


# ------------------------------------------------------------------ collective matmul (SP forward as ring steps)


def _collective_matmul_matches(group, kind, batch, seq_per_rank, hidden, out_per_rank, bias, seed):
    """Column (ring all-gather) and row (ring reduce-scatter) layers under sequence parallelism with
    collective_matmul: equal to dense and to the collective form; the forward moves its data in p - 1
    ring steps and issues no all-gather / reduce-scatter."""
    p = group.size()
    torch.manual_seed(seed)
    if kind == "column":
        dense = nn.Linear(hidden, out_per_rank * p, bias=bias).double()
        make = ColumnParallelLinear.from_dense
    else:
        dense = nn.Linear(out_per_rank * p, hidden, bias=bias).double()
        make = RowParallelLinear.from_dense
    layers = [make(dense, group=group, sequence_parallel=True) for _ in range(2)]
    assert tplayers.set_overlap(layers[1], collective_matmul=True)["collective_matmul"] == 1
    x = torch.randn(batch, seq_per_rank * p, dense.in_features, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    out_dim = -1 if kind == "column" else 1  # column output: (b, s, out/p); row: (b, s/p, hidden)
    assert_matches_dense(layers[1], dense, x, group=group, input_shard_dims=[1 if kind == "column" else -1],
                         output_shard_dim=out_dim)
    if kind == "row":  # the row layer takes the full sequence, features sharded
        x_local = tplayers.resolve_group(group).shard(x, -1)
    else:
        x_local = tplayers.resolve_group(group).shard(x, 1)
    outs = []
    for layer in layers:
        layer.zero_grad(set_to_none=True)  # (assert_matches_dense left its gradients)
        xi = x_local.clone().requires_grad_()
        with tplayers.comm_accounting() as acct:
            out = layer(xi)
        with tplayers.comm_accounting() as acct_bwd:
            out.square().sum().backward()
        outs.append((out, xi.grad, [q.grad for q in layer.parameters()], acct.records, acct_bwd.records))
    (ref, ref_dx, ref_g, _, _), (got, dx, grads, records, records_bwd) = outs
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)
    for a, b in zip(ref_g, grads):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    forward_ops = sorted(r.op for r in records)
    assert forward_ops == ["send"] * (p - 1), forward_ops
    # backward: the row layer gathers its output gradient in ring steps too; the column layer keeps
    # its collectives (they already run under its GEMMs)
    backward_ops = sorted(r.op for r in records_bwd)
    expected = ["send"] * (p - 1) if kind == "row" else ["all_gather", "reduce_scatter"]
    assert backward_ops == expected, backward_ops
    return True


@settings(max_examples=examples(4))
@given(kind=st.sampled_from(["column", "row"]), batch=st.integers(1, 2), seq_per_rank=st.integers(1, 3),
       hidden=st.integers(1, 6), out_per_rank=st.integers(1, 3), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_collective_matmul_matches_dense_and_the_collective_form(kind, batch, seq_per_rank, hidden, out_per_rank,
                                                                 bias, seed):
    for tp in (2, 4):
        assert all(get_world(tp).run(_collective_matmul_matches, kind, batch, seq_per_rank, hidden, out_per_rank,
                                     bias, seed))


def _block_with_collective_matmul(group):
    from tplayers.models.dense import DenseTransformerBlock

    torch.manual_seed(0)
    config = tplayers.BlockConfig(hidden=16, n_heads=4, n_kv_heads=2, ffn_hidden=32, activation="swiglu",
                                  norm="rmsnorm", bias=False, rotary=True)
    dense = DenseTransformerBlock(config).double()
    block = tplayers.ParallelTransformerBlock.from_dense(dense, group=group, sequence_parallel=True)
    counts = tplayers.set_overlap(block, collective_matmul=True, split_backward=True)  # regions fall back
    assert counts["collective_matmul"] == 4
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    assert_matches_dense(block, dense, x, group=group, input_shard_dims=[1], output_shard_dim=1)
    return True


def test_a_sequence_parallel_block_with_collective_matmul_matches_dense():
    for tp in (2, 4):
        assert all(get_world(tp).run(_block_with_collective_matmul))


def test_collective_matmul_needs_sequence_parallelism():
    with pytest.raises(ValueError, match="collective_matmul .* needs sequence_parallel=True"):
        tplayers.column_parallel_linear(torch.randn(2, 4), torch.randn(4, 4), group=None, collective_matmul=True)
    layer = ColumnParallelLinear(4, 4, group=None)
    assert tplayers.set_overlap(layer, collective_matmul=True)["collective_matmul"] == 0  # not sequence parallel
