"""A physics-informed neural network (PINN) for -u'' = f on [-1, 1], u(-1) = u(1) = 0.

    hpc-horovod run -np 2 python examples/pinn.py --mode data-parallel
    hpc-horovod run -np 2 python examples/pinn.py --mode ensemble
    srun python examples/pinn.py --mode data-parallel      # inside a SLURM job

The network u(x) is trained so that the residual -u''(x) - f(x) vanishes on collocation points
(derivatives by autograd) and u vanishes on the boundary; no solution data is used.

data-parallel
    f = 4 pi^2 sin(2 pi x), exact u = sin(2 pi x). The collocation points are split across
    ranks (one piece of the interval each; every rank also enforces the two boundary points).
    The DistributedOptimizer averages the gradients, so all ranks train one model on the whole
    interval.
ensemble
    Each rank solves its own problem with its own model and no averaging: even ranks
    f = pi^2 sin(pi x) (exact sin(pi x)), odd ranks f = 4 pi^2 sin(2 pi x) (exact sin(2 pi x)).
    Rank 0 gathers the solutions with allgather and reports each against its exact solution.

Rank 0 prints ``FINAL mode=... member=... rel_l2=...`` lines: the relative L2 error against the
exact solution on a fine grid.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch

import hpc_horovod.torch as hvd


def wavenumber(mode: str, member: int) -> int:
    """k of the problem f = (k pi)^2 sin(k pi x), exact u = sin(k pi x), solved by ``member``."""
    return 2 if mode == "data-parallel" or member % 2 else 1


def forcing(x: torch.Tensor, k: int) -> torch.Tensor:
    return (k * math.pi) ** 2 * torch.sin(k * math.pi * x)


def exact(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sin(k * math.pi * x)


def mlp(width: int, depth: int) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = [torch.nn.Linear(1, width), torch.nn.Tanh()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def piece(rank: int, size: int) -> tuple[float, float]:
    """The part of [-1, 1] whose collocation points ``rank`` owns in data-parallel mode."""
    return -1.0 + 2.0 * rank / size, -1.0 + 2.0 * (rank + 1) / size


def pde_loss(model: torch.nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
    """Mean squared residual of -u'' = f, scaled by (k pi)^4 so that k = 1 and k = 2 train
    alike, plus the squared boundary values."""
    x = x.detach().requires_grad_(True)
    u = model(x)
    du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
    d2u = torch.autograd.grad(du.sum(), x, create_graph=True)[0]
    residual = (-d2u - forcing(x, k)) / (k * math.pi) ** 2
    boundary = model(torch.tensor([[-1.0], [1.0]]))
    return residual.pow(2).mean() + boundary.pow(2).mean()


def relative_l2(prediction: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(prediction - reference) / np.linalg.norm(reference))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("data-parallel", "ensemble"), default="data-parallel")
    p.add_argument("--steps", type=int, default=2000, help="Adam steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--collocation", type=int, default=128,
                   help="collocation points: in all (data-parallel) or per rank (ensemble)")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--depth", type=int, default=2, help="hidden layers")
    p.add_argument("--eval-points", type=int, default=1001)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--plot", type=Path, help="save a figure of the solutions here (rank 0)")
    p.add_argument("--weights-out", type=Path,
                   help="directory for rank<N>.npy, each rank's final parameters, flattened")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(args.threads)
    rank, size = hvd.rank(), hvd.size()
    k = wavenumber(args.mode, rank)

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
        low, high = piece(rank, size)
        x = torch.linspace(low, high, max(2, args.collocation // size)).reshape(-1, 1)
    else:
        x = torch.linspace(-1.0, 1.0, args.collocation).reshape(-1, 1)

    losses = []
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = pde_loss(model, x, k)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            losses.append(loss.item())

    grid = torch.linspace(-1.0, 1.0, args.eval_points).reshape(-1, 1)
    with torch.no_grad():
        if args.mode == "data-parallel":
            # Same model everywhere: each rank solves on its share of the grid, allgather
            # concatenates the shares in rank order.
            share = torch.tensor_split(grid, size)[rank]
            solutions = hvd.allgather(model(share), name="solution").reshape(1, -1)
        else:
            solutions = hvd.allgather(model(grid).reshape(1, -1), name="solution")
    histories = hvd.allgather(torch.tensor([losses]), name="losses")

    if args.weights_out:
        args.weights_out.mkdir(parents=True, exist_ok=True)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        np.save(args.weights_out / f"rank{rank}.npy", flat.numpy())

    if rank == 0:
        solutions = solutions.numpy()
        references = []
        for index, solution in enumerate(solutions):
            k_index = wavenumber(args.mode, index)
            reference = exact(grid, k_index).numpy().ravel()
            references.append(reference)
            member = "all" if args.mode == "data-parallel" else index
            print(f"FINAL mode={args.mode} member={member} k={k_index} "
                  f"rel_l2={relative_l2(solution, reference):.4e}")
        if args.plot:
            plot(args, grid.numpy().ravel(), references, solutions, histories.numpy(), size)
    hvd.shutdown()


def plot(args, grid, references, solutions, histories, size) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (fit, curve) = plt.subplots(1, 2, figsize=(11, 4))
    for index, (reference, solution) in enumerate(zip(references, solutions)):
        k = wavenumber(args.mode, index)
        name = "PINN" if args.mode == "data-parallel" else f"member {index}"
        fit.plot(grid, reference, "k-", lw=2, alpha=0.4,
                 label=("exact sin(πx)" if k == 1 else f"exact sin({k}πx)") if index < 2 else None)
        fit.plot(grid, solution, "--", label=f"{name}, k={k}")
    if args.mode == "data-parallel":
        for rank in range(1, size):
            fit.axvline(piece(rank, size)[0], color="grey", lw=0.5)
    fit.set(xlabel="x", ylabel="u", title=f"-u'' = f, {args.mode}, {size} ranks")
    fit.legend()
    steps = np.minimum(np.arange(histories.shape[1]) * 50, args.steps - 1)
    for rank, history in enumerate(histories):
        curve.semilogy(steps, history, label=f"rank {rank} (local loss)")
    curve.set(xlabel="step", ylabel="PDE loss")
    curve.legend()
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
