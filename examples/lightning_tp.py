"""Lightning + tplayers: a LightningModule whose TP layers are built in ``configure_model`` from
the device mesh of Lightning's ``ModelParallelStrategy``. Runs on CPU with 2 processes:

    python examples/lightning_tp.py --devices 2 --steps 3 [--out result.json]

Each rank builds the layers under the same seed, so every rank holds its shard of the weights
that ``nn.Linear`` would have drawn: the run equals dense training (the test checks it).
Every TP rank must also see the same batch: ``tplayers.check_same_inputs`` (on by default here,
``--no-check-batches`` turns it off) stops the run on the first step they differ;
``--skew-batches`` makes that mistake on purpose (rank r adds r/1000 to its batch).
Lightning's own distributed sampler (on by default, left on here) is safe with TP: under
ModelParallelStrategy it splits the data over the ``data_parallel`` dim of the mesh only
(``num_replicas`` = its size, ``rank`` = this rank's index in it), so the TP ranks of one replica
draw the same batches; it shuffles (seed ``PL_GLOBAL_SEED``, 0 when unset), so the dense reference
trains on the same shuffled order.
"""
from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import tplayers
from tplayers.testing import dense_parameters

HIDDEN, CLASSES, SEED = 8, 5, 1234


def make_data(n: int = 12, seq: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    return TensorDataset(torch.randn(n, seq, HIDDEN, generator=g),
                         torch.randint(0, CLASSES, (n, seq), generator=g))


class TPClassifier(L.LightningModule):
    def __init__(self, lr: float = 0.1, check_batches: bool = True, skew_batches: bool = False) -> None:
        super().__init__()
        self.lr, self.check_batches, self.skew_batches = lr, check_batches, skew_batches

    def configure_model(self) -> None:
        tp_mesh = self.device_mesh["tensor_parallel"]  # a 1-D DeviceMesh: a valid tplayers group
        torch.manual_seed(SEED)  # every rank draws the same full weights and keeps its shard
        self.fc1 = tplayers.ColumnParallelLinear(HIDDEN, 4 * HIDDEN, group=tp_mesh)  # (b, s, 4h/p)
        self.fc2 = tplayers.RowParallelLinear(4 * HIDDEN, HIDDEN, group=tp_mesh)     # (b, s, h)
        self.head = nn.Linear(HIDDEN, CLASSES)                                       # replicated
        if self.check_batches:  # one all-gather of two int64 per step: TP ranks fed different batches fail loudly
            tplayers.check_same_inputs(self, group=tp_mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.skew_batches:  # the mistake on purpose: each TP rank a different batch
            x = x + self.global_rank / 1000
        loss = nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def dense_reference(steps: int, lr: float = 0.1, batch_size: int = 4) -> dict:
    """The same model built from plain nn.Linear layers, trained on the same batches: the order
    Lightning's sampler draws for the one data-parallel replica, epoch after epoch."""
    torch.manual_seed(SEED)
    fc1, fc2, head = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES)
    model = nn.ModuleDict({"fc1": fc1, "fc2": fc2, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data, batches, epoch = make_data(), [], 0
    while len(batches) < steps:  # Lightning calls set_epoch(epoch) on its sampler at each epoch
        order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=int(os.getenv("PL_GLOBAL_SEED", 0)))
        order.set_epoch(epoch)
        batches += list(DataLoader(data, batch_size=batch_size, sampler=list(order)))
        epoch += 1
    for x, y in batches[:steps]:
        opt.zero_grad()
        out = head(x + fc2(torch.nn.functional.gelu(fc1(x))))
        nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None,
                    help="write the max |tp - dense| weight error, the parameter names and the sampler (rank 0) as JSON")
    ap.add_argument("--check-batches", action=argparse.BooleanOptionalAction, default=True,
                    help="check every step that the TP ranks got the same batch (default: on)")
    ap.add_argument("--skew-batches", action="store_true",
                    help="the mistake, on purpose: feed each TP rank a slightly different batch")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # Lightning's distributed sampler stays on (use_distributed_sampler=True, the default): it splits over
    # the data-parallel dim only, so both TP ranks get every batch; check_same_inputs verifies it each step.
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, precision="32-true", max_steps=args.steps,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=args.devices),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    module = TPClassifier(check_batches=args.check_batches, skew_batches=args.skew_batches)
    trainer.fit(module, DataLoader(make_data(), batch_size=4))  # Lightning adds its DistributedSampler
    weights = dense_parameters(module)  # collective: gathers the TP shards on every rank
    if trainer.global_rank == 0:
        ref = dense_reference(args.steps)
        err = max(float((weights[k] - ref[k]).abs().max()) for k in ref)
        print(f"max |tp - dense| after {args.steps} steps: {err:.3e}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"max_abs_error": err, "names": sorted(weights),
                           "sampler": type(trainer.train_dataloader.sampler).__name__}, f)
    # Leave the process group before the interpreter exits: letting gloo's threads be torn down
    # at exit can abort the process ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
