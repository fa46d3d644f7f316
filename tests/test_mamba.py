"""Mamba-2 mixers split by heads (tplayers.layers.mamba): one mixer against its dense self at TP 1, 2 and 4 for
random head, group and state sizes (groups split over the ranks, or one group held whole by several ranks), the
collectives of a step counted, the fused training kernel never reached, and what cannot split refused. The
hybrid families that use it (Granite-MoE-Hybrid, Nemotron-H) are tested end to end in test_hf_families.py."""
import math
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import tplayers  # noqa: E402
from tplayers import testing  # noqa: E402
from tplayers.layers.mamba import ParallelMamba1, ParallelMamba2  # noqa: E402
from tplayers.testing import assert_matches_dense, dense_parameters, get_world  # noqa: E402

from conftest import examples  # noqa: E402

testing.FORKSERVER_PRELOAD.extend(["transformers.models.granitemoehybrid.modeling_granitemoehybrid",
                                   "transformers.models.jamba.modeling_jamba"])


def _norm_is_grouped() -> bool:
    import inspect

    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hybrid
    return "group_size" in inspect.signature(hybrid.GraniteMoeHybridRMSNormGated.__init__).parameters


# transformers before 5.2x (the lent GPU's 5.17) normalize the gated output over the mixer's whole width, not per
# group of B and C: such a mixer cannot split by heads (refused, naming the norm), so these tests skip there
needs_grouped_norm = pytest.mark.skipif(not _norm_is_grouped(), reason=f"transformers {transformers.__version__}'s "
                                        "gated RMSNorm spans the whole width (no group_size): refused, not split")


def _mixer(heads, head_dim, groups, state, bias, seed):
    """Granite-MoE-Hybrid's Mamba-2 mixer, float64, every parameter drawn at random (the per-head A_log, D,
    dt_bias and the norm's weight start equal across heads: a head read from the wrong rank would not show)."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

    hidden = heads * head_dim
    config = transformers.GraniteMoeHybridConfig(
        hidden_size=hidden, mamba_n_heads=heads, mamba_d_head=head_dim, mamba_expand=1, mamba_n_groups=groups,
        mamba_d_state=state, mamba_d_conv=3, mamba_chunk_size=4, mamba_conv_bias=bias, mamba_proj_bias=bias,
        num_hidden_layers=1, layer_types=["mamba"])
    torch.manual_seed(seed)
    mixer = GraniteMoeHybridMambaLayer(config, 0).double()
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if name in ("A_log", "dt_bias") else 0.5) + (1.0 if "norm" in name else 0))
    return mixer


def _check_mixer(group, heads, head_dim, groups, state, bias, tokens, seed):
    """Output, input gradient and every parameter's gradient equal the dense mixer's (its scan and norm compute in
    float32: 1e-5, an element near zero beside O(1) ones off by up to 1e-6); the weights come back whole; the collectives
    of one step."""
    dense = _mixer(heads, head_dim, groups, state, bias, seed)
    tp = ParallelMamba2.from_dense(dense, group=group)
    x = torch.randn(2, tokens, heads * head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    assert_matches_dense(tp, dense, x, group=group, rtol=1e-5, atol=1e-5)
    back = tp.to_dense()
    for (name, a), (_, b) in zip(back.named_parameters(), dense.named_parameters()):
        assert torch.equal(a, b), name
    with tplayers.comm_accounting(tp) as acc:
        tp(x.clone().requires_grad_()).sum().backward()
    return sorted((r.op, r.phase) for r in acc.records), tp.num_heads, tp.n_groups


@needs_grouped_norm
@pytest.mark.parametrize("tp", [1, 2, 4])
@settings(max_examples=examples(3))
@given(heads_per_unit=st.integers(1, 2), head_dim=st.integers(1, 3), groups=st.sampled_from([1, 2, 4, 8]),
       state=st.integers(1, 4), bias=st.booleans(), tokens=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_mamba2_mixer_split_by_heads_matches_dense(tp, heads_per_unit, head_dim, groups, state, bias, tokens, seed):
    """Heads split over the ranks; B and C's groups split too when they divide the TP degree, else each group held
    whole by the ranks whose heads read it (their gradients summed, the gated norm's sum of squares all-reduced).
    Sequences shorter than, equal to and longer than the scan's chunk (4)."""
    heads = math.lcm(groups, tp) * heads_per_unit
    for counts, local_heads, local_groups in get_world(tp).run(_check_mixer, heads, head_dim, groups, state, bias,
                                                               tokens, seed):
        assert local_heads == heads // tp and local_groups == max(groups // tp, 1)
        if tp == 1:
            assert counts == [], counts
        elif groups % tp == 0:  # Megatron's layout: out_proj's all-reduce forward, in_proj's input gradient backward
            assert counts == [("all_reduce", "backward"), ("all_reduce", "forward")], counts
        else:  # and the norm's sum of squares each way; B's and C's rows of in_proj and conv1d (weight, bias)
            sums = 2 * (2 if bias else 1)
            assert counts == sorted([("all_reduce", "forward")] * 2 + [("all_reduce", "backward")] * (2 + sums)), \
                counts


def _rms_norm_float64(norm, hidden_states):
    """JambaRMSNorm's math without its cast to float32."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return norm.weight * (hidden_states * torch.rsqrt(variance + norm.variance_epsilon))


def _float64_norms(mixer):
    """Jamba's RMSNorm computes in float32: in float64 here (on this object's own norms), so what is left of float32
    is the scan's."""
    for name in ("dt_layernorm", "b_layernorm", "c_layernorm"):
        norm = getattr(mixer, name)
        norm.forward = types.MethodType(_rms_norm_float64, norm)
    return mixer


def _jamba_mixer(hidden, expand, state, dt_rank, bias, seed):
    """Jamba's Mamba-1 mixer, float64, every parameter drawn at random (A_log, D, dt_proj's bias and the dt / B / C
    norms' weights start equal across channels)."""
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    config = transformers.JambaConfig(hidden_size=hidden, mamba_expand=expand, mamba_d_state=state, mamba_dt_rank=dt_rank,
                                      mamba_d_conv=3, mamba_conv_bias=bias, mamba_proj_bias=bias, num_hidden_layers=1,
                                      attn_layer_period=2, attn_layer_offset=1, num_attention_heads=1,
                                      num_key_value_heads=1)
    torch.manual_seed(seed)
    mixer = JambaMambaMixer(config, 0).double()
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if name in ("A_log", "dt_proj.bias") else 0.5)
                    + (1.0 if "norm" in name else 0))
    return mixer


def _check_jamba_mixer(group, hidden, expand, state, dt_rank, bias, tokens, seed):
    dense = _jamba_mixer(hidden, expand, state, dt_rank, bias, seed)
    tp = _float64_norms(ParallelMamba1.from_dense(dense, group=group))
    _float64_norms(dense)
    x = torch.randn(2, tokens, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    # the scan computes A, D and dt's bias in float32: each tensor to 1e-6 of its largest element (a missing sum is O(1))
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [dense(xs[0]), tp(xs[1])]
    grad = torch.randn(outs[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for out in outs:
        out.backward(grad)
    grads = dense_parameters(tp, grads=True)
    pairs = [("output", outs[1], outs[0]), ("input gradient", xs[1].grad, xs[0].grad)] + [
        (name, grads[name], p.grad) for name, p in dense.named_parameters()]
    for name, got, want in pairs:
        err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-12)
        assert err < 1e-6, f"rank {group.rank()}: {name} off by {err:.2e} of its largest element"
    back = tp.to_dense()
    for (name, a), (_, b) in zip(back.named_parameters(), dense.named_parameters()):
        assert torch.equal(a, b), name
    with tplayers.comm_accounting(tp) as acc:
        tp(x.clone().requires_grad_()).sum().backward()
    return sorted((r.op, r.phase) for r in acc.records), tp.intermediate_size


@pytest.mark.parametrize("tp", [1, 2, 4])
@settings(max_examples=examples(2))
@given(hidden_per_rank=st.integers(1, 3), expand=st.integers(1, 2), state=st.integers(1, 4), dt_rank=st.integers(1, 3),
       bias=st.booleans(), tokens=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_mamba1_mixer_split_by_channels_matches_dense(tp, hidden_per_rank, expand, state, dt_rank, bias, tokens, seed):
    """Jamba's Mamba-1 mixer, each inner channel its own recurrence: channels split over the ranks, x_proj's dt, B and
    C summed forward and their gradient backward, the dt / B / C norms' gradients summed. Forward 2 all-reduces,
    backward 3."""
    hidden = hidden_per_rank * tp
    for counts, local in get_world(tp).run(_check_jamba_mixer, hidden, expand, state, dt_rank, bias, tokens, seed):
        assert local == hidden * expand // tp
        if tp > 1:
            assert counts == sorted([("all_reduce", "forward")] * 2 + [("all_reduce", "backward")] * 3), counts


def _fused_kernel_not_reached(group):
    """transformers' fused training kernel takes out_proj's weight itself (no all-reduce): a sharded mixer in
    training mode never calls it (the dense one does), and its output is right."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as family

    calls = []
    real = family.mamba2_split_conv1d_scan_combined
    family.mamba2_split_conv1d_scan_combined = lambda *a, **k: calls.append(1)  # (None: the unfused path follows)
    try:
        dense = _mixer(4, 2, 1, 2, True, 0).train()
        tp = ParallelMamba2.from_dense(dense, group=group).train()
        x = torch.randn(1, 5, 8, dtype=torch.float64)
        dense(x)
        dense_calls = len(calls)
        out = tp(x)
        assert tp.training  # (restored after the forward)
    finally:
        family.mamba2_split_conv1d_scan_combined = real
    torch.testing.assert_close(out, dense(x), rtol=1e-5, atol=1e-7)
    return dense_calls, len(calls) - dense_calls


def _bfloat16(group):
    """The mixer in bfloat16 (one group held by both ranks): output and input gradient near the float64 mixer's."""
    exact = _mixer(4, 4, 1, 4, True, 1)
    tp = ParallelMamba2.from_dense(exact, group=group).to(torch.bfloat16)
    x = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xb = x.to(torch.bfloat16).requires_grad_()
    out = tp(xb)
    out.float().sum().backward()
    xd = x.clone().requires_grad_()
    ref = exact(xd)
    ref.sum().backward()
    scale = float(ref.abs().max())
    return float((out.double() - ref).abs().max()) / scale, float((xb.grad.double() - xd.grad).abs().max()) / float(
        xd.grad.abs().max()), out.dtype


@needs_grouped_norm
def test_sharded_mixer_never_takes_the_fused_kernel_and_runs_in_bfloat16():
    for dense_calls, tp_calls in get_world(2).run(_fused_kernel_not_reached):
        assert (dense_calls, tp_calls) == (1, 0)
    for out_err, grad_err, dtype in get_world(2).run(_bfloat16):
        assert dtype == torch.bfloat16 and out_err < 0.05 and grad_err < 0.05, (out_err, grad_err)


def _refusals(group):
    with pytest.raises(ValueError, match=r"3 heads do not divide the TP degree 2"):
        ParallelMamba2.from_dense(_mixer(3, 2, 1, 2, False, 0), group=group)
    with pytest.raises(ValueError, match=r"3 groups \(of B and C\) and the TP degree 2: one must divide the other"):
        ParallelMamba2.from_dense(_mixer(6, 2, 3, 2, False, 0), group=group)
    with pytest.raises(ValueError, match=r"module 'mamba' \(style MambaMixer\): .*3 heads do not divide"):
        tplayers.parallelize(torch.nn.ModuleDict({"mamba": _mixer(3, 2, 1, 2, False, 0)}), {"mamba": "mamba_mixer"},
                             group=group, audit=False)
    with pytest.raises(ValueError, match=r"not a Mamba-2 mixer of Hugging Face's layout \(no in_proj"):
        ParallelMamba2.from_dense(torch.nn.Linear(2, 2), group=group)
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer  # its norm: the gate after the norm
    config = transformers.FalconH1Config(hidden_size=8, mamba_n_heads=4, mamba_d_head=2, mamba_d_ssm=8, mamba_d_state=2,
                                         mamba_rms_norm=True, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"its norm FalconH1RMSNormGated is not a gated RMSNorm over the 1 groups"):
        ParallelMamba2.from_dense(FalconH1Mixer(config, 0), group=group)
    for part in ("A_log", "conv1d.weight", "norm.weight"):  # each cut from a copy that differs on one rank
        mixer = _mixer(4, 2, 1, 2, False, 0)
        if group.rank() == 1:
            with torch.no_grad():
                mixer.get_parameter(part).add_(1)
        with pytest.raises(ValueError, match=rf"the dense {part.split('.')[-1]} differs between rank 0 and rank 1"):
            ParallelMamba2.from_dense(mixer, group=group)
    return True


@needs_grouped_norm
def test_mixers_that_cannot_split_by_heads_are_refused_naming_why():
    assert all(get_world(2).run(_refusals))
