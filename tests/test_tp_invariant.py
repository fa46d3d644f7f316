"""parallelize(..., tp_invariant=True): the same bits at TP 1, 2 and 4 (logits, loss, every gradient, the parameters
after AdamW steps), float32 and bfloat16; what this version refuses."""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

import tplayers
from tplayers.convert.styles import Column, Row
from tplayers.core.comm import gather_from_sequence
from tplayers.testing import dense_parameters, get_world

STEPS = 5


def _llama(dtype: torch.dtype, family: str = "llama"):
    """A tiny HF Llama, Qwen3 (per-head q / k norms) or GPT-2 (fused c_attn, LayerNorm, tied head; no dropout)."""
    import transformers as hf

    torch.manual_seed(0)
    if family == "gpt2":
        return hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=64, n_layer=2, n_head=8, vocab_size=256, n_positions=64,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).to(dtype)
    config, cls = (hf.LlamaConfig, hf.LlamaForCausalLM) if family == "llama" else (hf.Qwen3Config, hf.Qwen3ForCausalLM)
    heads = (4, 16) if family == "qwen3-4heads" else (8, 8)  # (heads and KV heads, head_dim): 4 heads, 4 leaves
    config = config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=heads[0], num_key_value_heads=heads[0], head_dim=heads[1],
                    max_position_embeddings=64, tie_word_embeddings=False)
    return cls(config).to(dtype)


@contextlib.contextmanager
def _one_thread():
    """1 CPU thread, as every rank of a World: nn.LayerNorm's CPU backward sums per-thread partials (1 vs 2 differ)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # loss_parallel's logits: a DTensor at TP > 1


def _train(group, dtype_name: str, family: str = "llama", device: str = "cpu", **options):
    """5 AdamW steps of a tiny HF Llama / Qwen3 ("auto", tp_invariant, ``options`` to parallelize): the first step's
    logits and dense gradients, every loss, the dense parameters after the steps."""
    with _one_thread():
        return _steps(group, getattr(torch, dtype_name), family, torch.device(device), **options)


def _steps(group, dtype: torch.dtype, family: str, device: torch.device, **options):
    model = tplayers.parallelize(_llama(dtype, family).to(device), "auto", group=group, tp_invariant=True, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    losses, logits, grads = [], None, None
    for step in range(STEPS):
        with tplayers.comm_accounting() as acc:
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        if step == 0:
            logits, grads = _whole(out.logits).detach(), dense_parameters(model, grads=True)
        losses.append(out.loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    cpu = lambda ts: {n: t.cpu() for n, t in ts.items()}  # noqa: E731 (results leave the rank's process)
    return ([t.cpu() for t in losses], logits.cpu(), cpu(grads), cpu(dense_parameters(model)),
            Counter((r.phase, r.op, r.nbytes) for r in acc.records), str(tplayers.coverage(model).audit))


def _differences(a, b) -> list:
    losses_a, logits_a, grads_a, params_a = a[:4]
    losses_b, logits_b, grads_b, params_b = b[:4]
    found = [f"loss {i}" for i, (x, y) in enumerate(zip(losses_a, losses_b)) if not torch.equal(x, y)]
    found += ["logits"] if not torch.equal(logits_a, logits_b) else []
    found += [f"grad {n}" for n in grads_a if not torch.equal(grads_a[n], grads_b[n])]
    return found + [f"param {n}" for n in params_a if not torch.equal(params_a[n], params_b[n])]


SP_LP = dict(sequence_parallel=True, loss_parallel=True)  # the norms' gradients and the vocabulary's sums as leaves


@pytest.mark.parametrize("family, dtype, options", [
    ("llama", "float32", {}), ("llama", "bfloat16", {}), ("llama", "float32", SP_LP), ("llama", "bfloat16", SP_LP),
    ("qwen3", "float32", {}), ("qwen3", "bfloat16", SP_LP),  # per-head q / k norms: their gradients as leaves of heads
    ("qwen3-4heads", "float32", {}),  # 4 heads: the norms' gradients over 4 leaves of one head (before: refused)
    ("gpt2", "float32", {}), ("gpt2", "bfloat16", SP_LP),  # fused c_attn (each leaf its q, k, v blocks), LayerNorm
], ids=["llama-f32", "llama-bf16", "llama-sp-lp-f32", "llama-sp-lp-bf16", "qwen3-f32", "qwen3-sp-lp-bf16",
        "qwen3-4heads-f32", "gpt2-f32", "gpt2-sp-lp-bf16"])
def test_hf_models_train_to_the_same_bits_at_tp_1_2_and_4(family, dtype, options):
    pytest.importorskip("transformers")
    tp1 = _train(None, dtype, family, **options)
    for tp in (2, 4):
        for rank, result in enumerate(get_world(tp).run(_train, dtype, family, **options)):
            assert _differences(tp1, result) == [], f"TP {tp}, rank {rank}"


def test_the_step_under_sequence_parallelism_and_loss_parallel_sends_what_it_should():
    """The collectives of the Llama SP + loss_parallel step at TP 4 (b, s, h = 2, 16, 64; 2 layers; 32 tokens); the
    first step's audit compared each region with its TP-1 twin on the fixed-tree path, exactly."""
    pytest.importorskip("transformers")
    full, chunk, vec, sums = 2 * 16 * 64 * 4, 2 * 16 * 64 * 4 // 4, 64 * 4, 32 * 2 * 4
    # the tree's top over 4 ranks: an all-to-all of quarters (3 leave each rank), the tree, an all-gather of them
    for result in get_world(4).run(_train, "float32", **SP_LP):
        assert result[4] == Counter({
            ("forward", "reduce_scatter", full): 1,  # the embedding's sum into the sequence chunks (exact)
            ("forward", "all_gather", full): 5,  # the attentions' inputs, gate / up (siblings: one), the last norm
            ("forward", "all_to_all", 3 * chunk): 4,  # o_proj, down_proj: the tree's chunks (a reduce-scatter's bytes)
            ("forward", "all_reduce", 32 * 4): 1,  # the loss: the row maxima (exact)
            ("forward", "all_to_all", 3 * sums // 4): 1, ("forward", "all_gather", sums): 1,  # the vocabulary's sums
            ("backward", "all_to_all", 3 * chunk): 2 + 3,  # gate / up's input gradient's chunks; q / k / v's, the head's
            ("backward", "all_gather", full): 7 + 3,  # o / down output gradients, gate / up's input again, the
            # embedding; q / k / v, the head: their input gradient's summed quarters
            ("backward", "all_to_all", 3 * vec // 4): 5, ("backward", "all_gather", vec): 5,  # the norms' weights
        }), result[4]
        for region in ("model.layers.0.self_attn (LlamaAttention, x2)", "model.layers.0.mlp (LlamaMLP, x2)",
                       "lm_head (ParallelLMHead)", "model.embed_tokens (VocabParallelEmbedding)"):
            assert f"{region}: passed; worst output 0.0e+00 (tolerance 0: exact)" in result[5], result[5]


def _generate(group, family: str, dtype: str = "float32", batch: int = 2, sample: bool = False, **options):
    """Generation with a KV cache (a prefill, then one-token steps under no_grad), greedy or sampled (the same seed):
    the tokens and every step's scores (1 thread, as every World rank)."""
    with _one_thread():
        model = tplayers.parallelize(_llama(getattr(torch, dtype), family), "auto", group=group, tp_invariant=True,
                                     **options)
        ids = torch.randint(0, 256, (batch, 16), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(5)
        with torch.no_grad():
            out = model.eval().generate(ids, max_new_tokens=6, do_sample=sample, output_scores=True,
                                        return_dict_in_generate=True, pad_token_id=0)
        return out.sequences, torch.stack([_whole(s) for s in out.scores])


def test_sampling_at_one_degree_and_scoring_at_another_agree():
    """RL's two sides: a sampler's generation (prefill, then one-token decoding steps: the sequence-parallel region
    switched off, the norms run whole) gives the same tokens and the same scores' bits at TP 1, 2 and 4."""
    pytest.importorskip("transformers")
    tokens, scores = _generate(None, "llama", **SP_LP)
    for tp in (2, 4):
        for got_tokens, got_scores in get_world(tp).run(_generate, "llama", **SP_LP):
            assert torch.equal(tokens, got_tokens) and torch.equal(scores, got_scores), tp


@pytest.mark.parametrize("family, batch, sample, options", [("llama", 1, False, {}), ("qwen3", 1, False, {}),
                                                          ("llama", 2, True, SP_LP)])
def test_bfloat16_decoding_gives_the_same_bits_at_tp_1_2_and_4(family, batch, sample, options):
    """Issue 55: one-token steps in bfloat16 (batch 1 greedy, several sequences sampled with one seed). Before: at TP 4
    a step's scores differed from TP 1 (4.9e-4 Llama, 7.6e-6 Qwen3): each projection was one batched GEMM of 8/p
    blocks, and the batch count chose the kernel (this build's bf16 bmm takes oneDNN above 16^3)."""
    pytest.importorskip("transformers")
    tokens, scores = _generate(None, family, "bfloat16", batch, sample, **options)
    for tp in (2, 4):
        for got_tokens, got_scores in get_world(tp).run(_generate, family, "bfloat16", batch, sample, **options):
            assert torch.equal(tokens, got_tokens) and torch.equal(scores, got_scores), tp


def _gemm_calls(group):
    """The GEMM calls (op, operand shapes) one forward and backward of an invariant Column -> Row pair issues."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm,
                                       torch.ops.aten.baddbmm):
                self.seen[(func.overloadpacket.__name__,) + tuple(tuple(a.shape) for a in args[:2])] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = tplayers.parallelize(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)),
                                 {"0": "column", "1": "row"}, group=group, tp_invariant=True, audit=False)
    x = torch.randn(1, 1, 16, requires_grad=True)  # (b, s, h): a decoding step's one token
    with Calls() as calls:
        model(x).sum().backward()
    return calls.seen


def test_every_gemm_of_the_fixed_tree_has_one_shape_at_every_degree():
    """The kernel a GEMM takes can depend on every size it is given, so each block is its own GEMM call, the same
    shapes at every degree: TP p issues TP 1's calls, 1/p of them on each rank (before: one bmm of 8/p blocks)."""
    tp1 = _gemm_calls(None)
    assert set(op for op, *_ in tp1) == {"mm"}, tp1
    for tp in (2, 4):
        for calls in get_world(tp).run(_gemm_calls):
            assert calls == Counter({k: n // tp for k, n in tp1.items()}), (tp, calls, tp1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family, dtype, options", [("llama", "float32", {}), ("llama", "bfloat16", SP_LP),
                                                    ("gpt2", "bfloat16", {})])
def test_on_a_gpu_the_hf_models_give_the_same_bits(family, dtype, options):
    """The GPU route (docs/gpu.md): the same fixed-width blocks and tree on CUDA, ranks sharing one GPU over gloo.
    CUDA GEMMs choose kernels by shape; every block and leaf has one shape at every degree, the batch counts differ."""
    pytest.importorskip("transformers")
    tp1 = _train(None, dtype, family, "cuda", **options)
    for tp in (2, 4):
        for rank, result in enumerate(get_world(tp).run(_train, dtype, family, "cuda", **options)):
            assert _differences(tp1, result) == [], f"TP {tp}, rank {rank}"


def test_eight_ranks_give_the_same_bits():
    """TP 8: one leaf per rank (Llama with SP and loss_parallel in bf16; GPT-2's fused c_attn in float32)."""
    pytest.importorskip("transformers")
    world = get_world(8)  # (shared with tests/test_three_d.py)
    for family, dtype, options in (("llama", "bfloat16", SP_LP), ("gpt2", "float32", {})):
        tp1 = _train(None, dtype, family, **options)
        for rank, result in enumerate(world.run(_train, dtype, family, **options)):
            assert _differences(tp1, result) == [], f"{family}, rank {rank}"


class _Block(torch.nn.Module):
    """An own model: q, k, v read one x (``norm``: a LayerNorm of it), gelu MLP; a plan by patterns."""

    def __init__(self, h: int = 32, f: int = 64, norm: bool = False):
        super().__init__()
        self.ln = torch.nn.LayerNorm(h) if norm else torch.nn.Identity()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(h, h) for _ in range(4))
        self.up, self.down = torch.nn.Linear(h, f), torch.nn.Linear(f, h)

    def forward(self, x):  # (b, s, h), or this rank's (b, s/p, h) under sequence parallelism
        n = self.ln(x)
        a = self.o(torch.tanh(self.q(n)) * self.k(n) + self.v(n)) + x  # (elementwise on the split features)
        return self.down(torch.nn.functional.gelu(self.up(a))) + a


PLAN = {"q": "column", "k": "column", "v": "column", "o": "row", "up": "column", "down": "row"}
SP_PLAN = {"ln": "sequence_parallel_norm", **{n: Column(sequence_parallel=True) for n in ("q", "k", "v", "up")},
           **{n: Row(sequence_parallel=True) for n in ("o", "down")}}


def _own(group, dtype_name: str, sequence_parallel: bool):
    """5 AdamW steps of the own block, its input this rank's chunk of the sequence under sequence parallelism and
    its output gathered for the loss (1 thread: LayerNorm's CPU backward sums per-thread partials)."""
    with _one_thread():
        torch.manual_seed(0)
        dtype = getattr(torch, dtype_name)
        tp = tplayers.resolve_group(group)
        model = tplayers.parallelize(_Block(norm=True).to(dtype), SP_PLAN if sequence_parallel else PLAN, group=group,
                                     tp_invariant=True, check_inputs=0 if sequence_parallel else 1000)  # (shards in)
        x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(STEPS):
            if sequence_parallel:
                out = gather_from_sequence(model(tp.shard(x, -2)), group=group, grad_is_partial=False)
            else:
                out = model(x)
            loss = out.float().square().mean()
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
        return losses, dense_parameters(model)


@pytest.mark.parametrize("dtype, sequence_parallel", [("float32", False), ("bfloat16", True)])
def test_an_own_plan_trains_to_the_same_bits_at_tp_1_2_and_4(dtype, sequence_parallel):
    losses, params = _own(None, dtype, sequence_parallel)
    for tp in (2, 4):
        for got_losses, got_params in get_world(tp).run(_own, dtype, sequence_parallel):
            assert all(torch.equal(a, b) for a, b in zip(losses, got_losses)), (tp, losses, got_losses)
            assert [n for n in params if not torch.equal(params[n], got_params[n])] == [], tp


def _data_parallel(group, wrap: str, tp: int):
    """4 AdamW steps of the own block (with its LayerNorm) on a dp 2 x tp mesh, wrapped in DDP or FSDP2 over dp, each
    replica on its half of the batch: the losses and an output after the steps."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    with _one_thread():
        mesh = tplayers.make_2d_mesh(dp=2, tp=tp)
        torch.manual_seed(0)
        model = tplayers.parallelize(_Block(norm=True), PLAN, group=mesh.mesh, tp_invariant=True)
        if wrap == "ddp":
            trained = DDP(model, process_group=mesh.dp_group)
        else:
            for name in ("q", "k", "v", "o", "up", "down"):
                fully_shard(getattr(model, name), mesh=mesh.dp_mesh)
            trained = fully_shard(model, mesh=mesh.dp_mesh)
        opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
        x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1)).chunk(2)[mesh.dp_rank]
        losses = []
        for _ in range(4):
            loss = trained(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            out = trained(torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2)))
        return torch.stack(losses), out


@pytest.mark.filterwarnings("ignore:tplayers audit")  # (FSDP2's DTensor parameters: the audit steps aside)
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_under_ddp_and_fsdp2_the_bits_do_not_depend_on_the_tp_degree(wrap):
    """dp 2 x tp 1 (2 ranks) against dp 2 x tp 2 (4 ranks): each replica's losses and output after the steps are the
    same bits (without the mode they differ by ~4e-07)."""
    tp1 = get_world(2).run(_data_parallel, wrap, 1)
    for rank, (losses, out) in enumerate(get_world(4).run(_data_parallel, wrap, 2)):
        dp_rank = rank // 2  # the mesh's ranks: dp-major
        assert torch.equal(losses, tp1[dp_rank][0]) and torch.equal(out, tp1[dp_rank][1]), rank


def _kv_replicas_refused(group):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    try:
        tplayers.parallelize(qwen3, "auto", group=group, tp_invariant=True)
    except ValueError as e:
        assert type(qwen3.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # untouched
        return str(e)
    return "converted"


def test_what_the_mode_does_not_take_yet_is_refused_before_the_model_changes():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=36, n_layer=1, n_head=4, vocab_size=64, n_positions=16))
    with pytest.raises(ValueError, match=r"module 'transformer.h.0.attn.c_attn' \(FusedColumnParallelConv1D\): its "
                                         r"split features \(36\) are not 8"):
        tplayers.parallelize(gpt2, "auto", group=None, tp_invariant=True)
    assert type(gpt2.transformer.h[0].attn.c_attn).__name__ == "Conv1D"  # untouched
    model = tplayers.parallelize(GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64)), "auto",
                                 group=None, tp_invariant=True)  # GPT-2's default dropout (0.1)
    with pytest.raises(RuntimeError, match="this training forward drew random numbers"):
        model(torch.zeros(1, 8, dtype=torch.long))
    assert model.eval()(torch.zeros(1, 8, dtype=torch.long)).logits.shape == (1, 8, 64)
    with pytest.raises(ValueError, match=r"its split features \(36\) are not 8 whole leaves"):
        tplayers.parallelize(torch.nn.Sequential(torch.nn.Linear(8, 36), torch.nn.Linear(36, 8)),
                             {"0": "column", "1": "row"}, group=None, tp_invariant=True)
    for message in get_world(4).run(_kv_replicas_refused):  # (the reason: docs/layers.md)
        assert "'model.layers.0.self_attn." in message and "KV heads replicated over ranks" in message \
            and "the sum over the query heads sharing a KV head" in message, message
    model = tplayers.parallelize(_llama(torch.float32), "auto", group=None, tp_invariant=True, sequence_parallel=True)
    ids = torch.zeros(1, 12, dtype=torch.long)
    with pytest.raises(ValueError, match=r"'model.layers.0.input_layernorm' .* the input \(1, 12, 64\) does not cut"):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():  # no gradient (a decoding step): the norms run whole
        assert model(input_ids=ids).logits.shape == (1, 12, 256)


def test_a_switch_the_fixed_tree_would_ignore_is_refused():
    model = tplayers.parallelize(_Block(), PLAN, group=None, tp_invariant=True, audit=False)
    tplayers.set_overlap(model, delay_wgrad=True)
    with pytest.raises(RuntimeError, match="delay_wgrad is not available with it"):
        model(torch.randn(2, 4, 32))


def _own_collectives(group, autocast: bool):
    """The collectives of a step after the first (the audit's), float32 or under bf16 autocast."""
    torch.manual_seed(0)
    model = tplayers.parallelize(_Block(), PLAN, group=group, tp_invariant=True)
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))
    mixed = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    for step in range(2):
        with tplayers.comm_accounting() as acc, mixed():
            model(x).float().square().mean().backward()
    return [(r.phase, r.op, r.nbytes) for r in acc.records]


@pytest.mark.parametrize("autocast", [False, True])
def test_the_fixed_tree_sends_one_all_gather_per_split_sum(autocast):
    """Forward: one all-gather of each row layer's subtree sum (o, down); backward: one per column layer whose
    input needs a gradient (up; q, k, v read the input, which needs none), (b, s, h) per rank, in the dtype the
    layers compute in."""
    tp = 2
    full = tp * 4 * 8 * 32 * (2 if autocast else 4)  # the gathered (p, b*s, h) buffer
    for records in get_world(tp).run(_own_collectives, autocast):
        assert records == [("forward", "all_gather", full)] * 2 + [("backward", "all_gather", full)], records


# ---------------------------------------------------------------------------- RL: trainer, publishing, samplers


def _rl_trainer(group, dtype: str, route: str, path: str, options: dict):
    """The trainer (TP 2): 2 AdamW steps, then the weights published by ``route``: "dense" (dense_state_dict,
    torch.save on rank 0) or "checkpoint" (tplayers.save_checkpoint)."""
    import torch.distributed as dist

    with _one_thread():
        model = tplayers.parallelize(_llama(getattr(torch, dtype)), "auto", group=group, tp_invariant=True, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if route == "dense":
            state = tplayers.io.dense_state_dict(model)
            if dist.get_rank() == 0:
                torch.save(state, path)
            dist.barrier()
        else:
            tplayers.save_checkpoint(model, path)
        return {n: t.clone() for n, t in dense_parameters(model).items()}


def _rl_published(group, dtype: str, route: str, path: str, options: dict):
    """A model at this group's degree holding the published weights (loaded as users do by each route)."""
    model = _llama(getattr(torch, dtype))
    if route == "dense":  # into the dense model, then parallelize
        model.load_state_dict(torch.load(path, weights_only=True))
    model = tplayers.parallelize(model, "auto", group=group, tp_invariant=True, **options)
    if route == "checkpoint":
        tplayers.load_checkpoint(model, path, group=group)
    return model.eval()


def _rl_sampler(group, dtype: str, route: str, path: str, options: dict, sample: bool):
    """A sampler: generation from the published weights (prefill, one-token steps), greedy or sampled with one seed."""
    with _one_thread():
        model = _rl_published(group, dtype, route, path, options)
        prompts = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
        torch.manual_seed(5)
        with torch.no_grad():
            out = model.generate(prompts, max_new_tokens=8, do_sample=sample, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        return out.sequences, torch.stack([_whole(s) for s in out.scores])


def _rl_rescore(group, dtype: str, route: str, path: str, options: dict, sequences: torch.Tensor):
    """The trainer's re-scoring: the sampled tokens' log-probabilities from one full forward."""
    with _one_thread():
        model = _rl_published(group, dtype, route, path, options)
        with torch.no_grad():
            logits = _whole(model(input_ids=sequences).logits).float()
        return logits[:, 15:-1].log_softmax(-1).gather(-1, sequences[:, 16:, None])[..., 0]


@pytest.mark.parametrize("dtype, route, sample, options", [("float32", "dense", False, {}),
                                                           ("bfloat16", "checkpoint", True, SP_LP)],
                         ids=["f32-dense-greedy", "bf16-checkpoint-sampled-sp-lp"])
def test_rl_trainer_publishes_to_samplers_at_other_degrees_with_the_same_bits(tmp_path, dtype, route, sample, options):
    """Issue 55's RL loop: a trainer at TP 2 publishes its weights (dense_state_dict + load_state_dict, or
    save_checkpoint / load_checkpoint); samplers at TP 1 and TP 4 decode the same tokens and scores to the bit; the
    trainer's re-scoring of the samples at TP 2 equals TP 1's to the bit."""
    pytest.importorskip("transformers")
    path = str(tmp_path / ("weights.pt" if route == "dense" else "ckpt"))
    trained = get_world(2).run(_rl_trainer, dtype, route, path, options)[0]
    tp1 = _rl_sampler(None, dtype, route, path, options, sample)
    assert all(torch.equal(p, trained[n]) for n, p in dense_parameters(_rl_published(None, dtype, route, path,
                                                                                     options)).items())
    for tokens, scores in get_world(4).run(_rl_sampler, dtype, route, path, options, sample):
        assert torch.equal(tokens, tp1[0]) and torch.equal(scores, tp1[1])
    reference = _rl_rescore(None, dtype, route, path, options, tp1[0])
    for logprobs in get_world(2).run(_rl_rescore, dtype, route, path, options, tp1[0]):
        assert torch.equal(logprobs, reference)
