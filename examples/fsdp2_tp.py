"""TP x FSDP2 on a 2-D mesh (dp x tp), clipped with ``tplayers.clip_grad_norm_``, checked against
dense training on the global batch. Runs on CPU ranks (gloo), 4 of them (dp 2 x tp 2):

    python examples/fsdp2_tp.py [--steps 3] [--out result.json]    # starts 4 ranks itself (tplayers.testing.World)
    torchrun --nproc-per-node 4 examples/fsdp2_tp.py               # the same on torchrun's ranks

The recipe, in ``train``: ``make_2d_mesh(dp=2, tp=2)``; ``parallelize`` on the mesh (its ``"tp"``
dim); ``tplayers.audit`` (each converted region against its dense twin: before ``fully_shard``, which
it cannot see through); ``fully_shard`` each TP layer and then the model over ``mesh.dp_mesh`` (FSDP2 shards each TP
shard again, over dp); the optimizer built after ``fully_shard`` (its parameters are DTensors now);
each dp replica takes its part of the global batch; ``tplayers.clip_grad_norm_(model, max_norm)``
between backward and step. ``fully_shard`` returns the model itself (unlike DDP there is no
``.module``): pass ``model`` to ``clip_grad_norm_``. The norm counts each TP shard once and sums the
FSDP2 shards' parts over dp: it equals ``torch.nn.utils.clip_grad_norm_`` on the dense model.

The dense reference (the same model, the whole batch, torch's clip) runs on every rank; float64 so that
the comparison can be tight. On GPUs: the changes in docs/gpu.md (``torch.cuda.set_device``, NCCL, the
model on the GPU); ``make_2d_mesh`` then builds a CUDA mesh. Checkpoints:
``tplayers.save_checkpoint(model, path, optimizer=optimizer)`` / ``load_checkpoint`` (any dp and TP size, every
layout), or DCP's ``get_state_dict`` / ``set_state_dict``, which see each TP shard as a DTensor over the (dp, tp) mesh.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import warnings
from typing import Dict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import tplayers
from tplayers.layers import model_placements
from tplayers.testing import World

HIDDEN, CLASSES, GLOBAL_BATCH, SEQ, LR = 8, 5, 4, 3, 1e-2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> (b, s, classes)
        return self.head(x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))))


PLAN = {"fc1": "column", "fc2": "row"}  # norm and head stay replicated over TP


def train(group: dist.ProcessGroup, steps: int = 3, max_norm: float = 0.05) -> Dict[str, object]:
    """Runs on every rank of a 4-rank world; returns what this rank measured against dense."""
    # FSDP2 warns that the model returns a view (nn.Linear on (b, s, h) does); only in-place ops on it would hurt
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = tplayers.make_2d_mesh(dp=2, tp=2)                 # DeviceMesh dims ("dp", "tp"), TP innermost
    torch.manual_seed(0)                                     # the same dense model on every rank
    dense = Net().double()
    model = tplayers.parallelize(copy.deepcopy(dense), PLAN, group=mesh.mesh)   # uses the "tp" dim
    example = torch.randn(1, SEQ, HIDDEN, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    audit = tplayers.audit(model, example)                   # before fully_shard: after it the parameters
    assert audit.passed, audit                               # are DTensors, which the audit skips
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh.dp_mesh)                # each TP shard, sharded again over dp
    fully_shard(model, mesh=mesh.dp_mesh)                    # the rest (norm, head); returns model itself
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # after fully_shard: DTensor parameters
    dense_optimizer = torch.optim.AdamW(dense.parameters(), lr=LR)

    g = torch.Generator().manual_seed(1)                     # the same global batches on every rank
    norms, dense_norms = [], []
    for _ in range(steps):
        x = torch.randn(GLOBAL_BATCH, SEQ, HIDDEN, generator=g, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (GLOBAL_BATCH, SEQ), generator=g)
        x_dp, y_dp = x.chunk(mesh.dp_size)[mesh.dp_rank], y.chunk(mesh.dp_size)[mesh.dp_rank]  # TP ranks share it
        nn.functional.cross_entropy(model(x_dp).flatten(0, 1), y_dp.flatten()).backward()  # FSDP2 averages over dp
        norms.append(float(tplayers.clip_grad_norm_(model, max_norm)))  # the dense model's norm
        optimizer.step()
        optimizer.zero_grad()

        nn.functional.cross_entropy(dense(x).flatten(0, 1), y.flatten()).backward()  # the whole batch
        dense_norms.append(float(torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm)))
        dense_optimizer.step()
        dense_optimizer.zero_grad()

    # this rank's TP shard of every parameter (gathered over dp) against the dense one, cut the same way
    placements, wanted = model_placements(model), dict(dense.named_parameters())
    weight_error = 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            mine = p.full_tensor()                           # FSDP2: the whole TP shard, gathered over dp
            want = wanted[name]
            if name in placements:
                want = placements[name].shard(want, mesh.tp.rank, mesh.tp.size)
            weight_error = max(weight_error, float((mine - want).abs().max()))
    return {"steps": steps, "grad_norms": norms, "clipped_steps": sum(n > max_norm for n in dense_norms),
            "max_norm_error": max(abs(a - b) for a, b in zip(norms, dense_norms)), "max_weight_error": weight_error}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the worst errors over the ranks as JSON")
    args = ap.parse_args()
    if "RANK" in os.environ:                                 # under torchrun: this process is one rank
        dist.init_process_group("gloo")
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, train(dist.group.WORLD, args.steps))  # every rank's, for the worst
        report = dist.get_rank() == 0
    else:                                                    # 4 CPU ranks, with timeouts: never a hang
        with World(4, timeout=120) as world:
            results = world.run(train, args.steps)
        report = True
    if report:
        worst = {**results[0], **{k: max(r[k] for r in results) for k in ("max_norm_error", "max_weight_error")}}
        print(f"dp 2 x tp 2, {worst['steps']} AdamW steps, clipped at {worst['clipped_steps']}: "
              f"max |fsdp2 x tp - dense| grad norm {worst['max_norm_error']:.1e}, weights {worst['max_weight_error']:.1e}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(worst, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
