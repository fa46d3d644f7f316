"""What a GPU pays per step beside the collectives in a converted Hugging Face model, counted on the CPU: one
simulated rank of TP ``--tp`` (the fake process group) runs one steady-state training step of a Llama of Llama-3's
shape ratios (``parallelize(model, "auto", loss_parallel=True)``, with ``--sequence-parallel`` or not); kernels and
bytes written by data movement (in activations, b*s*h float32 elements), by the site that wrote them with
``--by-site``. Deterministic: no timing. The audit and the consistency checks are off (the fake group's collectives
return no data), and so are the collective checks (their copies are counted in benchmarks/RESULTS.md apart).

    python benchmarks/hf_step_counts.py --tp 8 --sequence-parallel [--by-site]
"""
from __future__ import annotations

import argparse
import collections
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tplayers
from tplayers.bench.counts import MOVES, count_step, tensor_bytes
from tplayers.bench.simulate import simulated_rank


class _BySite(TorchDispatchMode):
    """Bytes written by data-movement ops, by the innermost frames of tplayers or transformers that issued them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in MOVES:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if ("tplayers" in f.filename or "transformers" in f.filename) and "benchmarks" not in f.filename]
            where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in frames[-3:][::-1])
            self.sites[(name, where)] += tensor_bytes(out)
        return out


def main() -> None:
    import transformers
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=3584)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--by-site", action="store_true")
    args = ap.parse_args()
    with simulated_rank(args.tp) as group:
        tplayers.set_collective_checks(False)
        cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                       num_hidden_layers=args.layers, vocab_size=args.vocab, attn_implementation="sdpa")
        torch.manual_seed(0)
        model = tplayers.parallelize(transformers.LlamaForCausalLM(cfg), "auto", group=group,
                                     sequence_parallel=args.sequence_parallel, loss_parallel=True, audit=False,
                                     check_consistency=False, check_inputs=0)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()

        step()
        step()
        counts = count_step(step)
        activation = args.batch * args.seq * args.hidden * 4
        print(f"HF Llama, {args.layers} layer(s), TP {args.tp}{' SP' if args.sequence_parallel else ''}, (b, s, h) = "
              f"({args.batch}, {args.seq}, {args.hidden}), ffn {args.ffn}, heads {args.heads} / {args.kv_heads} KV, "
              f"vocab {args.vocab}, float32: {counts['kernels']} kernels, {counts['moved_bytes'] / activation:.2f} "
              f"activations moved, {counts['host_syncs']} host syncs")
        if args.by_site:
            with _BySite() as sites:
                step()
            for (name, where), nbytes in sites.sites.most_common():
                if nbytes >= activation / 100:
                    print(f"{nbytes / activation:6.2f} {name:10s} {where}")


if __name__ == "__main__":
    main()
