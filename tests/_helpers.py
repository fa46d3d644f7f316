"""Helpers the test files share: the TP sizes and dtype most tests use, a free TCP port, and the
float64 checks of layer layouts and of the transformer block that the block-level files (MLP,
attention, block, interleave, GPT) run on the rank worlds, and a backward's timeline of collectives and weight-gradient
GEMMs. Imported as ``from _helpers import ...``
(pytest puts tests/, conftest.py's folder, on sys.path)."""
import socket

import torch
import torch.nn as nn
from hypothesis import strategies as st

import tplayers
from tplayers import BlockConfig, ParallelTransformerBlock
from tplayers.models.dense import DenseTransformerBlock
from tplayers.core.groups import resolve_group
from tplayers.layers import TensorParallelModule
from tplayers.testing import assert_matches_dense

TP_SIZES = [1, 2, 4]
MULTI_RANK = [2, 4]  # tests of what crosses ranks (collectives, ranks that disagree): TP 1 has none
F64 = torch.float64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ layers and blocks vs dense


class _WithMask(nn.Module):
    """Binds an attention mask so assert_matches_dense sees a one-input module."""

    def __init__(self, inner, mask):
        super().__init__()
        self.inner, self.mask = inner, mask

    def forward(self, x):
        return self.inner(x, self.mask)


def _check_layouts(tp_module, dense_module, group):
    """Every TP child's param_placements() cuts exactly its local parameters from the dense ones."""
    g = resolve_group(group)
    dense_params = dict(dense_module.named_parameters())
    seen = 0
    for prefix, mod in tp_module.named_modules():
        if not isinstance(mod, TensorParallelModule):
            continue
        for name, layout in mod.param_placements().items():
            full = dense_params[f"{prefix}.{name}" if prefix else name]
            assert torch.equal(layout.shard(full, g.rank, g.size), getattr(mod, name)), f"{prefix}.{name}"
            seen += 1
    assert seen == len(dense_params), "every dense parameter has a layout"


def _make_mask(kind, batch, heads, seq, gen):
    if kind == "none":
        return None
    if kind == "bool":  # (b, s, s), every query keeps itself so no row is fully masked
        return (torch.rand(batch, seq, seq, generator=gen) < 0.7) | torch.eye(seq, dtype=torch.bool)
    return torch.randn(batch, heads, seq, seq, generator=gen, dtype=F64)  # additive, per head


def _io_dims(sequence_parallel):
    return dict(input_shard_dims=[1] if sequence_parallel else None, output_shard_dim=1 if sequence_parallel else None)



def _check_block(group, config, batch, seq, mask_kind, sequence_parallel, seed, dtype=F64, chunks=1,
                 delay_wgrad=False, main_grad=False):
    torch.manual_seed(seed)
    dense = DenseTransformerBlock(config, dtype=dtype)
    with torch.no_grad():  # non-trivial norm weights, so their gradients are tested for real
        for name, p in dense.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    tp = ParallelTransformerBlock.from_dense(dense, group=group, sequence_parallel=sequence_parallel)
    tplayers.set_overlap(tp, chunks=chunks, delay_wgrad=delay_wgrad)
    if main_grad:
        tplayers.use_main_grad(tp, dtype=dtype)
    _check_layouts(tp, dense, group)
    assert type(tp.to_dense()) is DenseTransformerBlock
    mask = _make_mask(mask_kind, batch, config.n_heads, seq, torch.Generator().manual_seed(seed))
    x = torch.randn(batch, seq, config.hidden, dtype=dtype)
    return assert_matches_dense(_WithMask(tp, mask), _WithMask(dense, mask), x, group=group,
                                **_io_dims(sequence_parallel)).grad_error



configs = st.builds(
    BlockConfig,
    hidden=st.integers(2, 8),
    n_heads=st.just(4),
    ffn_hidden=st.sampled_from([4, 8]),
    n_kv_heads=st.sampled_from([None, 1, 2]),
    head_dim=st.sampled_from([2, 4]),
    activation=st.sampled_from(["gelu", "swiglu"]),
    norm=st.sampled_from(["layernorm", "rmsnorm"]),
    bias=st.booleans(),
    causal=st.booleans(),
    rotary=st.booleans(),
)


# ------------------------------------------------------------------ the order of a backward


class Timeline:
    """A backward's collectives (launched, waited for) and weight-gradient GEMMs in order: an observer of the
    launches (``tplayers.core.collectives.set_observer``) and a dispatch mode (``mode``) together. ``shapes``: the
    weight shapes to watch, each with its name in ``events`` (an ``mm`` or ``addmm`` whose result has that shape)."""

    def __init__(self, shapes):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.events, timeline = [], self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.overloadpacket.__name__ in ("mm", "addmm", "addmm_") and tuple(out.shape) in shapes:
                    timeline.events.append(shapes[tuple(out.shape)])
                return out

        self.mode = _Mode()

    def launch(self, op, nbytes, g, device, call):
        self.events.append(f"launch {op}")
        return call(), op

    def finished(self, token, wait_started):
        self.events.append(f"wait {token}")


class Calls:
    """Counts the calls of ``module.<name>`` (a function tplayers calls by its module's global) while entered, in this
    process: ``with Calls(tplayers.convert.gated_mlp, "rank_major_row_linear") as calls: ...; calls.n``."""

    def __init__(self, module, name: str) -> None:
        self.module, self.name, self.n = module, name, 0

    def __enter__(self):
        self.original = getattr(self.module, self.name)

        def counted(*args, **kwargs):
            self.n += 1
            return self.original(*args, **kwargs)

        setattr(self.module, self.name, counted)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.original)
