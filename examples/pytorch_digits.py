"""Data-parallel training of a digit classifier (scikit-learn's 8x8 digits) with
hpc_horovod.torch: the usual Horovod recipe, end to end.

    hpc-horovod run -np 2 python examples/pytorch_digits.py --epochs 5

What every rank does: pin a device, read its shard of the data (DistributedSampler), scale the
learning rate by the number of ranks, wrap the optimizer, start from rank 0's weights (or from
the newest checkpoint), validate on its shard and average the metric over ranks weighted by
sample counts. Only rank 0 prints and writes checkpoints, atomically (``hpc_horovod.checkpoint``:
a temporary file renamed over the final name; the three newest are kept).
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hpc_horovod.torch as hvd
from hpc_horovod.checkpoint import (
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="train up to this epoch")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size")
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--no-resume", action="store_true",
                        help="start from scratch, removing the checkpoints of earlier runs")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def pick_device() -> torch.device:
    """One GPU per rank when there are GPUs (local rank modulo their number), else the CPU."""
    if torch.cuda.is_available():
        index = hvd.local_rank() % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    # Ranks share the node's cores: do not let each rank start one thread per core.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    return torch.device("cpu")


def datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The same 80/20 split on every rank (fixed seed)."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(x))
    train, val = order[:n_train], order[n_train:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def train_epoch(model, loader, optimizer, device) -> float:
    model.train()
    total, count = 0.0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item() * len(x)
        count += len(x)
    # The mean training loss over every rank's samples.
    sums = hvd.allreduce(torch.tensor([total, float(count)], dtype=torch.float64), op=hvd.Sum,
                         name="train.loss")
    return float(sums[0] / sums[1])


@torch.no_grad()
def validate(model, dataset, device) -> tuple[float, int]:
    """Accuracy over the whole validation set: each rank scores its shard, then the correct
    predictions and the sample counts are summed over ranks (shards may differ in size)."""
    model.eval()
    correct, count = 0, 0
    for x, y in DataLoader(dataset, batch_size=256):
        pred = model(x.to(device)).argmax(dim=1)
        correct += int((pred == y.to(device)).sum())
        count += len(y)
    sums = hvd.allreduce(torch.tensor([correct, count], dtype=torch.int64), op=hvd.Sum,
                         name="val.accuracy")
    return float(sums[0]) / float(sums[1]), int(sums[1])


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    device = pick_device()
    torch.manual_seed(args.seed)

    train_set, val_set = datasets(args.seed)
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    val_shard = Subset(val_set, range(hvd.rank(), len(val_set), hvd.size()))

    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    # Rank 0 decides where to start; it alone reads the checkpoint, then broadcasts.
    path = None
    if hvd.rank() == 0 and args.no_resume:
        for _, old in list_checkpoints(args.checkpoint_dir):
            os.remove(old)  # so that a later resume never picks an older run's checkpoint
    elif hvd.rank() == 0:
        path = latest_checkpoint(args.checkpoint_dir)
    start_epoch = hvd.broadcast_object(checkpoint_step(path) if path else 0, root_rank=0,
                                       name="resume_epoch")
    if path is not None:
        state = torch.load(path, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        print(f"resuming from {path} (epoch {start_epoch}, accuracy {state['accuracy']:.4f})",
              flush=True)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if hvd.rank() == 0:
        print(f"training on {hvd.size()} rank(s), device {device}, epochs "
              f"{start_epoch + 1}..{args.epochs}", flush=True)
    for epoch in range(start_epoch + 1, args.epochs + 1):
        sampler.set_epoch(epoch)
        loss = train_epoch(model, loader, optimizer, device)
        accuracy, n_val = validate(model, val_shard, device)
        if hvd.rank() == 0:  # rank 0 alone writes, atomically (temporary file, then rename)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "accuracy": accuracy}
            saved = save_checkpoint(functools.partial(torch.save, state), args.checkpoint_dir,
                                    step=epoch)
            print(f"epoch {epoch}/{args.epochs}: train loss {loss:.4f}  val accuracy "
                  f"{accuracy:.4f} ({n_val} samples)  saved {saved}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
