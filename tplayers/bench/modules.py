"""The module kinds the benchmark times (``--module mlp | column | block``): how each is built dense,
as its TP twin, as one rank's computation alone, and with the split backward; and naive model
parallelism (fc1 on rank 0, fc2 on rank 1) for the MLP."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.blocking import broadcast_tensor
from ..core.groups import TPGroup
from ..layers import ColumnParallelLinear, RowParallelLinear, set_overlap
from ..models.blocks import ParallelMLP, ParallelTransformerBlock
from ..models.dense import BlockConfig, DenseMLP, DenseTransformerBlock
from .config import MODULE_NAMES, BenchConfig


__all__ = ["ModuleKind", "MODULES", "tp_model", "naive_step"]


@dataclass(frozen=True)
class ModuleKind:
    """How the benchmark builds one module kind.

    ``dense(cfg)``: the full model (random init); ``tp(dense, g, sequence_parallel)``: its TP twin
    from the same weights; ``local(dense, cfg, g)``: the TP model's computation with no
    communication (plain modules of one rank's shard shapes); ``split(dense, g, sequence_parallel,
    chunks)``: the TP twin with the split backward over ``chunks`` batch chunks (None: the module
    has no column -> row region to split).
    """

    dense: Callable[["BenchConfig"], nn.Module]
    tp: Callable[[nn.Module, TPGroup, bool], nn.Module]
    local: Callable[[nn.Module, "BenchConfig", TPGroup], nn.Module]
    split: Optional[Callable[[nn.Module, TPGroup, bool, int], nn.Module]] = None


def _linear_shard(lin: nn.Linear, dim: int, g: TPGroup) -> nn.Linear:
    """A plain ``nn.Linear`` holding this rank's shard of ``lin`` (dim 0: column, 1: row)."""
    shape = list(lin.weight.shape)  # (out, in)
    shape[dim] //= g.size
    out = nn.Linear(shape[1], shape[0]).to(lin.weight.device, lin.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(g.shard(lin.weight, dim))
        out.bias.copy_(g.shard(lin.bias, 0) if dim == 0 else lin.bias)
    return out


def _block_config(cfg: "BenchConfig") -> BlockConfig:
    return BlockConfig(hidden=cfg.hidden, n_heads=cfg.heads, ffn_hidden=cfg.ffn, n_kv_heads=cfg.kv_heads,
                       activation=cfg.activation, norm=cfg.norm)


def _local_block_config(cfg: "BenchConfig", p: int) -> BlockConfig:
    """One rank's shard of the block as a plain block: its heads, KV heads (one, replicated, when
    there are fewer KV heads than ranks) and ffn slice."""
    kv = cfg.kv_heads or cfg.heads
    return replace(_block_config(cfg), n_heads=cfg.heads // p, n_kv_heads=max(1, kv // p), ffn_hidden=cfg.ffn // p,
                   head_dim=cfg.hidden // cfg.heads)


def _split_mlp(d: nn.Module, g: TPGroup, sp: bool, chunks: int) -> nn.Module:
    """The bench MLP (Linear, GELU, Linear) as a ParallelMLP with the split backward (same weights)."""
    dense = DenseMLP(d[0].in_features, d[0].out_features, "gelu", True, device=d[0].weight.device,
                     dtype=d[0].weight.dtype)
    dense.fc1.load_state_dict(d[0].state_dict())
    dense.fc2.load_state_dict(d[2].state_dict())
    return ParallelMLP.from_dense(dense, group=g, sequence_parallel=sp, split_backward=True, chunks=chunks)


def _split_block(d: nn.Module, g: TPGroup, sp: bool, chunks: int) -> nn.Module:
    block = ParallelTransformerBlock.from_dense(d, group=g, sequence_parallel=sp)
    set_overlap(block, split_backward=True, chunks=chunks)  # attention and MLP
    return block


MODULES: Dict[str, ModuleKind] = {
    "mlp": ModuleKind(
        dense=lambda c: nn.Sequential(nn.Linear(c.hidden, c.ffn), nn.GELU(), nn.Linear(c.ffn, c.hidden)),
        tp=lambda d, g, sp: nn.Sequential(ColumnParallelLinear.from_dense(d[0], group=g, sequence_parallel=sp),
                                          nn.GELU(),
                                          RowParallelLinear.from_dense(d[2], group=g, sequence_parallel=sp)),
        local=lambda d, c, g: nn.Sequential(_linear_shard(d[0], 0, g), nn.GELU(), _linear_shard(d[2], 1, g)),
        split=_split_mlp),
    "column": ModuleKind(
        dense=lambda c: nn.Linear(c.hidden, c.ffn),
        tp=lambda d, g, sp: ColumnParallelLinear.from_dense(d, group=g, sequence_parallel=sp),
        local=lambda d, c, g: _linear_shard(d, 0, g)),
    # attention (qkv column, proj row) then MLP (fc1 column, fc2 row); local: this rank's heads and
    # ffn slice as a plain block (its own random weights: only its shapes matter for timing)
    "block": ModuleKind(
        dense=lambda c: DenseTransformerBlock(_block_config(c)),
        tp=lambda d, g, sp: ParallelTransformerBlock.from_dense(d, group=g, sequence_parallel=sp),
        local=lambda d, c, g: DenseTransformerBlock(_local_block_config(c, g.size)).to(
            d.attn.qkv.weight.device, d.attn.qkv.weight.dtype),
        split=_split_block),
}
assert tuple(MODULES) == MODULE_NAMES, "bench.config.MODULE_NAMES names MODULES in order"


def tp_model(dense: nn.Module, cfg: "BenchConfig", g: TPGroup, overlap: bool) -> nn.Module:
    """The TP twin of ``dense`` with ``overlap_comm`` set on every submodule that has it."""
    model = MODULES[cfg.module].tp(dense, g, cfg.sequence_parallel)
    set_overlap(model, overlap_comm=overlap)
    return model


def naive_step(dense: nn.Module, cfg: "BenchConfig", g: TPGroup, x: torch.Tensor,
               grad: torch.Tensor) -> Callable[[], None]:
    """fc1 (+GELU) on rank 0, fc2 on rank 1: activations and their gradient sent between them."""
    fc1, fc2 = dense[0], dense[2]
    b, s = x.shape[0], x.shape[1]
    act = torch.zeros(b, s, cfg.ffn, dtype=x.dtype, device=x.device)  # (b, s, ffn)
    mine = list((fc1 if g.rank == 0 else fc2).parameters())

    def step() -> None:
        x.grad = None
        for p in mine:
            p.grad = None
        if g.rank == 0:
            h = F.gelu(fc1(x))
            broadcast_tensor(h, 0, group=g)  # send activations to rank 1
            h.backward(broadcast_tensor(act, 1, group=g))  # receive their gradient
        else:
            h = broadcast_tensor(act, 0, group=g).requires_grad_(True)
            fc2(h).backward(grad)
            broadcast_tensor(h.grad, 1, group=g)

    return step
