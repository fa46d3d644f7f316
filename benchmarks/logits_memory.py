"""What one training step of a Hugging Face Llama with a large vocabulary holds in logits per rank:
``parallelize(..., loss_parallel=True)`` (logits split by vocabulary through the loss) against the
logits gathered for the model's own loss, and the dense model. COUNTED, not timed: the bytes of the
logits the forward returns and of the vocabulary-wide tensors autograd saves for backward (found with
``saved_tensors_hooks``: tensors whose last dim is the local or the full vocabulary).

    PYTHONPATH=. python benchmarks/logits_memory.py [--vocab 32000] [--tp 2] [--tokens 4x256]
"""
from __future__ import annotations

import argparse
import copy

import torch

import tplayers
from tplayers.testing import World


def _held(model, ids, widths) -> tuple:
    """(bytes of the returned logits, bytes of vocabulary-wide tensors saved for backward) of one step."""
    seen = {}

    def pack(t):
        if t.dim() and t.shape[-1] in widths:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, labels=ids)
    logits = out.logits.numel() * out.logits.element_size()
    out.loss.backward()
    return logits, sum(seen.values())


def _rank(group, vocab: int, batch: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    dense = LlamaForCausalLM(cfg)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    p = tplayers.resolve_group(group).size
    widths = {vocab, -(-vocab // p)}
    rows = {"dense": _held(dense, ids, widths)}
    for loss_parallel in (False, True):
        model = tplayers.parallelize(copy.deepcopy(dense), "auto", group=group, loss_parallel=loss_parallel)
        model(ids, labels=ids).loss.backward()  # the first step (the audit)
        model.zero_grad(set_to_none=True)
        rows["loss_parallel" if loss_parallel else "logits gathered"] = _held(model, ids, widths)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", default="4x256", help="batch x sequence")
    args = ap.parse_args()
    batch, seq = (int(n) for n in args.tokens.split("x"))
    with World(args.tp) as world:
        rows = world.run(_rank, args.vocab, batch, seq)[0]
    dense_logits, dense_saved = rows["dense"]
    print(f"COUNTED, HF Llama (2 layers, hidden 256), vocabulary {args.vocab}, {batch} x {seq} tokens, float32, "
          f"TP {args.tp}, rank 0:")
    for name, (logits, saved) in rows.items():
        print(f"  {name:<16} logits returned {logits / 2**20:8.1f} MiB ({logits / dense_logits:.3f} of dense); "
              f"vocabulary-wide tensors saved for backward {saved / 2**20:8.1f} MiB ({saved / dense_saved:.3f} of dense)")


if __name__ == "__main__":
    main()
