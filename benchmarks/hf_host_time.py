"""Host time of a converted Hugging Face Llama's sequence-parallel step, one simulated rank of TP ``--tp`` (the fake
process group: the collectives move nothing, so the Python and the rank's own compute are what is timed). The
collective checks are off (the fake group's collectives return no data).

    PYTHONPATH=<tree> python benchmarks/hf_host_time.py --what mlp     # the converted MLP's own step, tiny widths
    PYTHONPATH=<tree> python benchmarks/hf_host_time.py --what model   # the whole 1-layer model's step
    PYTHONPATH=<tree> python benchmarks/hf_host_time.py --what model --hidden 1024 --ffn 3584 --heads 16 \\
        --kv-heads 8 --seq 512 --vocab 256 --median   # the rank's step at benchmarks/hf_step_counts.py's shape

Run two trees alternately and compare paired ratios (this box is shared and noisy).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import tplayers
from tplayers.bench.simulate import simulated_rank

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mlp_host_time import min_us_per_step  # noqa: E402  (the same timing loop)


def main() -> None:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("mlp", "model"), default="model")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=224)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--median", action="store_true", help="median of 15 steps (large shapes) instead of min of 5 x 200")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with simulated_rank(args.tp) as group:
        tplayers.set_collective_checks(False)
        cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                       num_hidden_layers=1, vocab_size=args.vocab, attn_implementation="sdpa")
        torch.manual_seed(0)
        model = tplayers.parallelize(transformers.LlamaForCausalLM(cfg), "auto", group=group, sequence_parallel=True,
                                     loss_parallel=True, audit=False, check_consistency=False, check_inputs=0)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        mlp = model.model.layers[0].mlp
        x = torch.randn(args.batch, args.seq // args.tp, args.hidden, requires_grad=True)  # this rank's chunk

        def step() -> None:
            if args.what == "model":
                model(input_ids=ids, labels=ids).loss.backward()
            else:
                mlp(x).sum().backward()

        if args.median:
            for _ in range(3):
                step()
            times = []
            for _ in range(15):
                t = time.perf_counter()
                step()
                times.append((time.perf_counter() - t) * 1e3)
            print(f"{args.what}: {statistics.median(times):.2f} ms (median of 15)")
            return
        print(f"{args.what}: {min_us_per_step(step, warmup=20):.1f} us (min of 5 x 200)")


if __name__ == "__main__":
    main()
