"""What `parallelize(..., tp_invariant=True)` costs: an HF Llama training step (forward + backward) with and
without it, alternating step by step in one run (paired ratio of the slower rank's step), the bytes per step
(comm_accounting: deterministic), and at TP 1 the invariant model's logits against the plain dense model's.

    PYTHONPATH=. python benchmarks/tp_invariant_cost.py [--tp 2] [--layers 2] [--repeats 10] [--link match:h100-nvlink]
        [--sp-lp]

``--sp-lp``: both models with ``sequence_parallel=True, loss_parallel=True`` (called with labels: the loss on the
vocabulary shards).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import tplayers
from tplayers.bench.budget import wire_bytes
from tplayers.bench.measure import resolve_link
from tplayers.bench.report import quartiles
from tplayers.core.blocking import all_reduce_tensor
from tplayers.core.groups import resolve_group
from tplayers.testing import World


def _llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024,
                                        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                                        max_position_embeddings=512, tie_word_embeddings=False))


def _rank(group, layers: int, repeats: int, link: str, sp_lp: bool):
    models = {mode: tplayers.parallelize(_llama(layers), "auto", group=group, tp_invariant=mode, audit=False,
                                         check_inputs=0, sequence_parallel=sp_lp, loss_parallel=sp_lp)
              for mode in (False, True)}
    ids = torch.randint(0, 4096, (4, 256), generator=torch.Generator().manual_seed(1))
    times, nbytes = {False: [], True: []}, {}
    with tplayers.emulated_link(resolve_link(link, resolve_group(group))) if link else contextlib.nullcontext():
        for i in range(2 * repeats + 2):
            mode = i % 2 == 1
            with tplayers.comm_accounting() as acc:
                t0 = time.perf_counter()
                models[mode](input_ids=ids, labels=ids).loss.backward()
                elapsed = time.perf_counter() - t0
            models[mode].zero_grad(set_to_none=True)
            nbytes[mode] = sum(wire_bytes(r.op, r.nbytes, group.size()) for r in acc.records)
            if i >= 2:
                times[mode].append(1e3 * elapsed)
    slowest = lambda v: all_reduce_tensor(torch.tensor(v), group=group, op="max").tolist()  # noqa: E731
    return slowest(times[False]), slowest(times[True]), nbytes


def _tp1_vs_dense(layers: int, sp_lp: bool) -> float:
    ids = torch.randint(0, 4096, (4, 256), generator=torch.Generator().manual_seed(1))
    dense = _llama(layers)
    invariant = tplayers.parallelize(_llama(layers), "auto", group=None, tp_invariant=True, audit=False,
                                     sequence_parallel=sp_lp, loss_parallel=sp_lp)
    with torch.no_grad():
        return float((invariant(input_ids=ids).logits - dense(input_ids=ids).logits).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--link", default=None, help="an emulated link (e.g. match:h100-nvlink); default: real gloo")
    parser.add_argument("--sp-lp", action="store_true", help="sequence_parallel=True, loss_parallel=True")
    args = parser.parse_args()
    with World(args.tp) as world:
        plain, invariant, nbytes = world.run(_rank, args.layers, args.repeats, args.link, args.sp_lp)[0]
    ratios = [b / a for a, b in zip(plain, invariant)]
    q = quartiles(ratios)
    print(f"{'EMULATION (' + args.link + ')' if args.link else 'real gloo'}, TP {args.tp}, "
          f"{'SP + loss_parallel, ' if args.sp_lp else ''}HF Llama {args.layers} "
          f"layers (hidden 256, ffn 1024, vocab 4096, batch 4 x 256): step {statistics.median(plain):.1f} -> "
          f"{statistics.median(invariant):.1f} ms (medians); paired ratio tp_invariant / default "
          f"{statistics.median(ratios):.3f}x (quartiles {q[1]:.3f}-{q[2]:.3f}) over {len(ratios)} pairs; wire bytes "
          f"per step {nbytes[False] / 1e6:.2f} -> {nbytes[True] / 1e6:.2f} MB ({nbytes[True] / nbytes[False]:.2f}x)")
    print(f"TP 1 tp_invariant vs plain dense logits: max abs difference {_tp1_vs_dense(args.layers, args.sp_lp):.3g}")


if __name__ == "__main__":
    main()
