"""What a GPU pays per step, counted on the CPU (tplayers.bench.counts): kernels, bytes moved by copies, GEMM
FLOPs, host syncs. Deterministic, so asserted here: no schedule's steady-state step syncs the host, and under
sequence parallelism the schedules reorder only each layer's per-rank side (core/seq_order.py), never the
whole activation once per collective as they did (10 activations of copies per block step at TP 8)."""
import contextlib
import json

import pytest
import torch

import tplayers
from tplayers.bench.config import BenchConfig
from tplayers.bench.counts import StepCounts, count_step
from tplayers.bench.overlap import MODE_TABLE, BenchInputs
from tplayers.cli import main
from tplayers.core.groups import resolve_group
from tplayers.testing import get_world


def test_counts_of_known_ops():
    a, b = torch.randn(4, 8), torch.randn(8, 16)
    with StepCounts() as c:
        y = a @ b  # one GEMM: 2 * 4 * 16 * 8 FLOPs
        z = y.t().contiguous()  # a copy of 64 float32
        _ = z.view(-1)  # a view: no kernel
        _ = float(z.sum())  # a host read: one sync
    d = c.as_dict()
    assert d["gemm_flops"] == 2 * 4 * 16 * 8
    assert d["moved_bytes"] == 64 * 4 and d["moved_bytes_by_op"] == {"clone": 256}
    assert d["host_syncs"] == 1 and d["host_syncs_by_op"] == {"_local_scalar_dense": 1}
    assert d["kernels"] == 3  # mm, clone, sum


BLOCK = dict(module="block", batch=2, seq=16, hidden=64, ffn=96, heads=8, kv_heads=4, activation="swiglu",
             norm="rmsnorm", chunks=2)


def _counts(group, sequence_parallel: bool, modes, checks: bool = True):
    """Each mode's steady-state step counted; ``checks``: the collective checks on (the default) or off (the
    schedule's own copies alone: a checked collective copies its buffer into one with the fingerprint slots)."""
    g = resolve_group(group)
    inputs = BenchInputs.create(g, BenchConfig(**BLOCK, sequence_parallel=sequence_parallel))
    previous = tplayers.set_collective_checks(checks)  # (on every rank alike)
    try:
        out = {}
        for name in modes:
            if MODE_TABLE[name].skip(inputs) is not None:
                continue
            step = MODE_TABLE[name].build(inputs)
            step()
            step()  # steady state: caches warm, every lazy set-up done
            out[name] = count_step(step)
        return out
    finally:
        tplayers.set_collective_checks(previous[0], timeout=previous[1])


SCHEDULES = ("tp", "tp_blocking", "tp_split", "tp_chunked", "tp_cm", "compute")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_no_schedule_syncs_the_host(sequence_parallel):
    """With the collective checks on (the default): a host read would stall a GPU's launch queue every step."""
    for rank, counts in enumerate(get_world(2).run(_counts, sequence_parallel, SCHEDULES)):
        assert set(counts) >= {"tp", "tp_split", "tp_chunked", "compute"}
        for mode, c in counts.items():
            assert c["host_syncs"] == 0, f"rank {rank}, {mode}: {c['host_syncs_by_op']}"


# what each TP size's block copies per token beyond the matmuls alone: the attention's per-rank side only (hidden 64,
# 8 heads, gelu ffn 128). TP 8: q/k/v's 24 wide output forward and its gradient backward, o_proj's 8 wide input
# forward and it and its gradient backward. TP 2, where q/k/v is wider (96) than the hidden size: q/k/v forward in
# the sequence's order (the gathered input, 64), backward rank-major (96); o_proj forward rank-major (32), backward
# in the sequence's order (the gathered output gradient, 64).
ATTENTION_COPIES = {8: 24 + 24 + 8 + 2 * 8, 2: 64 + 96 + 32 + 64}


@pytest.mark.parametrize("tp", sorted(ATTENTION_COPIES))
def test_sequence_parallel_reorders_only_the_attentions_per_rank_side(tp, capsys):
    """`tplayers bench --simulate` (one rank of TP 8 or 2, the fake process group) counts each mode's step in its
    JSON. Under sequence parallelism, batch 2, each pass of each attention layer copies its per-rank side only
    (core/seq_order.py's table) beside the matmuls alone's copies; before, every all-gather's result and every
    reduce-scatter's input were copied whole: 10 activations per step at TP 8. The MLP (fc1 -> activation -> fc2)
    keeps its tokens rank-major from one GEMM to the other in every schedule at any widths (region.keeps_rank_major),
    so none of its per-rank sides is copied: before, at TP 8 fc1's 16 wide output and fc2's 16 wide input were
    (but in the split backward), at TP 2 each pass's cheaper order copied 4 activations."""
    rc = main(["bench", "--simulate", "--tp", str(tp), "--module", "block", "--batch", "2", "--seq", "16", "--hidden",
               "64", "--ffn", "128", "--heads", "8", "--sequence-parallel", "--modes", "tp,tp_blocking,tp_split,compute",
               "--iters", "1", "--warmup", "1", "--json", "--no-progress", "--link", "1/5"])
    assert rc == 0
    counts = json.loads(capsys.readouterr().out)["counts"]
    b, s, h, itemsize = 2, 16, 64, 4
    norms = 2 * 2 * h * itemsize  # the two LayerNorms' weight and bias gradients, copied to be all-reduced (SP)
    for mode in ("tp", "tp_blocking", "tp_split"):
        extra = counts[mode]["moved_bytes"] - counts["compute"]["moved_bytes"]
        assert extra == b * s * ATTENTION_COPIES[tp] * itemsize + norms, (
            f"{mode}: {extra / (b * s * h * itemsize):.2f} activations moved beyond the matmuls alone's, expected "
            f"{ATTENTION_COPIES[tp] / h:.2f}: {counts[mode]['moved_bytes_by_op']}")
        assert counts[mode]["host_syncs"] == 0 and counts[mode]["gemm_flops"] == counts["compute"]["gemm_flops"]
        # per layer one gather forward, two backward (the output gradient, the input re-gathered), one reduce-scatter
        # each way; the norms' four parameter gradients all-reduced
        assert counts[mode]["collectives"] == {"_allgather_base_": 6, "_reduce_scatter_base_": 4, "allreduce_": 4}


def test_a_swiglu_mlp_under_sequence_parallelism_copies_less_than_the_matmuls_alone():
    """One simulated rank of TP 8, SwiGLU: the MLP's region writes gate's and up's input gradients in their halves of
    one buffer (its activation's backward by hand), where autograd, and the matmuls alone, concatenate them (2 x 12
    features per token); what is left beyond them is the attention's per-rank side (q/k/v 24 out, o_proj 8 in)."""
    from tplayers.bench.simulate import simulated_rank

    b, s, h, itemsize = 2, 16, 64, 4
    cfg = BenchConfig(module="block", batch=b, seq=s, hidden=h, ffn=96, heads=8, kv_heads=8, activation="swiglu",
                      norm="rmsnorm", sequence_parallel=True)
    counts = {}
    with simulated_rank(8) as group:
        inputs = BenchInputs.create(resolve_group(group), cfg)
        for name in ("compute", "tp", "tp_blocking", "tp_split"):
            step = MODE_TABLE[name].build(inputs)
            step()
            step()
            counts[name] = count_step(step)
    attention, gate_up = 24 + 24 + 8 + 2 * 8, 2 * 96 // 8
    norms = 2 * 2 * h * itemsize  # (RMSNorm: weights only, two each)
    for mode in ("tp", "tp_blocking", "tp_split"):
        extra = counts[mode]["moved_bytes"] - counts["compute"]["moved_bytes"]
        assert extra == b * s * (attention - gate_up) * itemsize + norms // 2, (
            f"{mode}: {extra} bytes beyond the matmuls alone's: {counts[mode]['moved_bytes_by_op']}, compute "
            f"{counts['compute']['moved_bytes_by_op']}")


class _SyncSites(StepCounts):
    """Host syncs by the file that issued them (the innermost frame under tplayers/ or transformers/)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites = []

    def record(self, func, args, kwargs, out):
        import traceback

        if func.overloadpacket.__name__ in ("_local_scalar_dense", "is_nonzero", "equal", "nonzero"):
            frames = [f for f in traceback.extract_stack() if ("/tplayers/" in f.filename or "/transformers/" in f.filename)
                      and "/tplayers/bench/" not in f.filename]
            self.sites.append(f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?")
        return super().record(func, args, kwargs, out)


def _hf_step_syncs(group, sequence_parallel: bool):
    """A converted HF Llama's steady-state training step (loss_parallel, the checks on, as users run it)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, vocab_size=100, attn_implementation="sdpa")
    model = tplayers.parallelize(transformers.LlamaForCausalLM(cfg), "auto", group=group, loss_parallel=True,
                                 sequence_parallel=sequence_parallel)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    step()
    step()
    with _SyncSites() as counts:
        step()
    return counts.sites


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_a_converted_hf_step_syncs_the_host_only_in_the_cpu_id_checks(sequence_parallel):
    """Issue 52: on a GPU a host sync stalls the launch queue every step. The vocabulary-parallel loss read whether
    its shard has padding columns off the device (bool(real.all())) at every step; the host knows it. What is left
    on the CPU is the token-id range check's CPU branch (core/validate.py: a device-side assert on a GPU)."""
    pytest.importorskip("transformers")
    for sites in get_world(2).run(_hf_step_syncs, sequence_parallel):
        assert sites and all("tplayers/core/validate.py" in site for site in sites), sites


def _embedding_step_moves(group, b: int, s: int, h: int, route: str):
    """One steady-state step of a vocabulary-parallel embedding entering sequence parallelism, ``route``: ``layer``
    (``sequence_parallel=True``: the layer reduce-scatters its lookup), ``partial`` (``partial_output=True``: a
    Hugging Face model's route, the first block reduce-scatters the PartialSum), ``positions`` (the same plus GPT-2's
    position embeddings added first). Bytes moved, by op."""
    from tplayers import VocabParallelEmbedding

    torch.manual_seed(0)
    emb = VocabParallelEmbedding(50, h, group=group, sequence_parallel=route == "layer",
                                 partial_output=route != "layer")
    positions = torch.randn(1, s, h, requires_grad=True)
    ids = torch.randint(0, 50, (b, s), generator=torch.Generator().manual_seed(1))

    def step():
        out = emb(ids)
        if route == "positions":
            out = out + positions
        if route != "layer":
            out = out.reduce_scatter()
        out.square().sum().backward()

    step()
    step()
    return count_step(step)["moved_bytes_by_op"]


@pytest.mark.parametrize("route", ["layer", "partial", "positions"])
def test_an_embedding_enters_sequence_parallelism_without_reordering_its_lookup(route):
    """Issue 52: under sequence parallelism with a batch (b > 1) the embedding's reduce-scatter took its input's
    blocks out of the sequence's order, and its backward all-gather put the gradient back into it: two copies of the
    whole activation per step (2.0 of the 8.4 a converted Llama's SP step moved at TP 8). The lookup is made in the
    collective's rank-major order instead: only the ids (b*s integers) are reordered. One simulated rank of TP 8."""
    from tplayers.bench.simulate import simulated_rank

    b, s, h = 2, 16, 16
    with simulated_rank(8) as group:
        moved = _embedding_step_moves(group, b, s, h, route)
    copies = sum(n for op, n in moved.items() if op in ("clone", "copy_", "cat", "contiguous"))
    assert copies == b * s * 8, f"{route}: {copies / (b * s * h * 4):.2f} activations copied: {moved}"


@contextlib.contextmanager
def _converted_llama_rank(h: int = 64):
    """A 1-layer Llama (hidden ``h``, ffn 224, 8 heads) converted with sequence parallelism on one simulated rank of
    TP 8 (the fake process group), the collective checks off there (its collectives return no data)."""
    transformers = pytest.importorskip("transformers")
    from tplayers.bench.simulate import simulated_rank

    with simulated_rank(8) as group:
        previous = tplayers.set_collective_checks(False)
        try:
            cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=224, num_attention_heads=8,
                                           num_key_value_heads=8, num_hidden_layers=1, vocab_size=64)
            torch.manual_seed(0)
            yield tplayers.parallelize(transformers.LlamaForCausalLM(cfg), "auto", group=group, sequence_parallel=True,
                                       loss_parallel=True, audit=False, check_consistency=False, check_inputs=0)
        finally:
            tplayers.set_collective_checks(previous[0], timeout=previous[1])


def test_a_converted_gated_mlp_keeps_its_tokens_rank_major():
    """Issue 52: a converted Hugging Face MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) under sequence
    parallelism with a batch reordered its tokens between the collectives' rank-major order and the sequence's:
    gate / up's gather (the whole input), down's input forward, its input and input gradient backward, gate / up's
    output gradients (3.2 activations per step at TP 8 with Llama-3's ratios). Between the GEMMs only token-wise ops
    run, so the tokens now stay rank-major from gate / up's GEMMs to down's: nothing is copied. One simulated rank
    of TP 8, the MLP's own steady-state step."""
    b, s, h = 2, 16, 64
    with _converted_llama_rank(h) as model:
        mlp = model.model.layers[0].mlp
        x = torch.randn(b, s // 8, h, requires_grad=True)  # this rank's sequence chunk

        def step():
            mlp(x).square().sum().backward()

        step()
        step()
        moved = count_step(step)["moved_bytes_by_op"]
    copies = sum(n for op, n in moved.items() if op in ("clone", "copy_", "cat", "contiguous"))
    assert copies == 0, f"{copies / (b * s * h * 4):.2f} activations copied: {moved}"


class _SequenceGathers(StepCounts):
    """Bytes that all-gathers' results copied into the sequence's order (their ``finish``: b > 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.reordered = 0

    def record(self, func, args, kwargs, out):
        import traceback

        if func.overloadpacket.__name__ == "clone" and any(
                f.name == "finish" and f.filename.endswith("tplayers/core/collectives.py")
                for f in traceback.extract_stack()):
            self.reordered += out.numel() * out.element_size()
        return super().record(func, args, kwargs, out)


def test_a_converted_attention_gathers_its_input_in_rank_major_order():
    """Issue 52: HF attention gathers its input because its code reads the input's (b, s); under sequence parallelism
    with a batch that gather was copied into the sequence's order (one activation per layer per step). Its code reads
    only the shape (watched at the first forward), and q / k / v together are narrower than the input at TP 8, so
    later steps gather in the collective's own rank-major order and q / k / v put their outputs in the sequence's
    order instead (3 x 8 features per token against 64). What is left: the final norm's gather for the LM head (HF
    slices it). One simulated rank of TP 8, a 1-layer Llama's steady-state step."""
    b, s, h = 2, 16, 64
    with _converted_llama_rank(h) as model:
        ids = torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(1))

        def step():
            model(input_ids=ids, labels=ids).loss.backward()

        step()
        step()
        with _SequenceGathers() as counts:
            step()
    assert counts.reordered == b * s * h * 4, f"{counts.reordered / (b * s * h * 4):.2f} activations reordered"
