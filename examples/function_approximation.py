"""Fit y = sin(2 pi x) + sin(4 pi x) on [-1, 1] with a small MLP, data-parallel or as an ensemble.

    hpc-horovod run -np 2 python examples/function_approximation.py --mode data-parallel
    hpc-horovod run -np 2 python examples/function_approximation.py --mode ensemble
    srun python examples/function_approximation.py --mode ensemble      # inside a SLURM job

data-parallel
    The interval is cut into one piece per rank and each rank fits only its piece. The
    DistributedOptimizer averages the gradients, so every step follows the gradient of the loss
    on the whole interval and all ranks hold the same model. (Each rank's loss is a mean over as
    many points as the others', so the averaged gradient is the full-batch gradient: the
    learning rate is not scaled with the number of ranks.)
ensemble
    Each rank trains its own model (its own initialisation, its own random sample of the
    interval) and nothing is averaged: N ranks give N independent models. Rank 0 gathers their
    predictions with allgather and reports each member and the ensemble mean.

Rank 0 prints ``FINAL mode=... member=... rel_l2=...`` lines: the relative L2 error against the
exact function on a fine grid.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch

import hpc_horovod.torch as hvd


def target(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(2 * math.pi * x) + torch.sin(4 * math.pi * x)


def mlp(width: int, depth: int) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = [torch.nn.Linear(1, width), torch.nn.Tanh()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def piece(rank: int, size: int) -> tuple[float, float]:
    """The part of [-1, 1] that ``rank`` owns when the domain is split across ranks."""
    return -1.0 + 2.0 * rank / size, -1.0 + 2.0 * (rank + 1) / size


def training_points(mode: str, n: int, rank: int, size: int, seed: int) -> torch.Tensor:
    if mode == "data-parallel":
        low, high = piece(rank, size)
        return torch.linspace(low, high, n).reshape(-1, 1)
    generator = torch.Generator().manual_seed(seed + rank)
    return (2.0 * torch.rand(n, 1, generator=generator) - 1.0)


def relative_l2(prediction: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(prediction - exact) / np.linalg.norm(exact))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("data-parallel", "ensemble"), default="data-parallel")
    p.add_argument("--steps", type=int, default=3000, help="Adam steps")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--points", type=int, default=128, help="training points per rank")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2, help="hidden layers")
    p.add_argument("--eval-points", type=int, default=1001)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--plot", type=Path, help="save a figure of the fit here (rank 0)")
    p.add_argument("--weights-out", type=Path,
                   help="directory for rank<N>.npy, each rank's final parameters, flattened")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(args.threads)
    rank, size = hvd.rank(), hvd.size()

    # A different initialisation on every rank: the ensemble needs it, and in data-parallel
    # mode the broadcast below is what makes the ranks agree.
    torch.manual_seed(args.seed + 1000 * rank)
    model = mlp(args.width, args.depth)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.mode == "data-parallel":
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    x = training_points(args.mode, args.points, rank, size, args.seed)
    y = target(x)
    losses = []
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            losses.append(loss.item())

    grid = torch.linspace(-1.0, 1.0, args.eval_points).reshape(-1, 1)
    with torch.no_grad():
        if args.mode == "data-parallel":
            # Same model everywhere: each rank predicts its share of the grid, allgather
            # concatenates the shares in rank order.
            share = torch.tensor_split(grid, size)[rank]
            predictions = hvd.allgather(model(share), name="prediction").reshape(1, -1)
        else:
            predictions = hvd.allgather(model(grid).reshape(1, -1), name="prediction")
    histories = hvd.allgather(torch.tensor([losses]), name="losses")

    if args.weights_out:
        args.weights_out.mkdir(parents=True, exist_ok=True)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        np.save(args.weights_out / f"rank{rank}.npy", flat.numpy())

    if rank == 0:
        exact = target(grid).numpy().ravel()
        predictions = predictions.numpy()
        if args.mode == "data-parallel":
            error = relative_l2(predictions[0], exact)
            print(f"FINAL mode=data-parallel member=all rel_l2={error:.4e}")
        else:
            for member, prediction in enumerate(predictions):
                print(f"FINAL mode=ensemble member={member} "
                      f"rel_l2={relative_l2(prediction, exact):.4e}")
            mean = predictions.mean(axis=0)
            print(f"FINAL mode=ensemble member=mean rel_l2={relative_l2(mean, exact):.4e}")
        if args.plot:
            plot(args, grid.numpy().ravel(), exact, predictions, histories.numpy(), size)
    hvd.shutdown()


def plot(args, grid, exact, predictions, histories, size) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (fit, curve) = plt.subplots(1, 2, figsize=(11, 4))
    fit.plot(grid, exact, "k-", lw=2, label="exact")
    for member, prediction in enumerate(predictions):
        label = "model" if args.mode == "data-parallel" else f"member {member}"
        fit.plot(grid, prediction, "--", label=label)
    if args.mode == "data-parallel":
        for rank in range(1, size):
            fit.axvline(piece(rank, size)[0], color="grey", lw=0.5)
    fit.set(xlabel="x", ylabel="y", title=f"sin(2πx) + sin(4πx), {args.mode}, {size} ranks")
    fit.legend()
    steps = np.minimum(np.arange(histories.shape[1]) * 50, args.steps - 1)
    for rank, history in enumerate(histories):
        curve.semilogy(steps, history, label=f"rank {rank} (local loss)")
    curve.set(xlabel="step", ylabel="mean squared error")
    curve.legend()
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
