"""One process: the cost of ``hpc_horovod.torch.DistributedOptimizer`` over the optimizer it
wraps, on ``training.py``'s CNN (batch 32, one compute thread). Both optimizers train their own
copy of the model in alternating blocks of steps; the script prints the median step times and
their ratio (the wrapper must stay within 2% of the plain optimizer).

    python benchmarks/torch_optimizer_overhead.py [blocks]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training import build_model  # noqa: E402

import hpc_horovod.torch as hvd  # noqa: E402

STEPS_PER_BLOCK = 5


def make(distributed: bool):
    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    return model, opt


def main(blocks: int) -> None:
    torch.set_num_threads(1)
    hvd.init()
    if hvd.size() != 1:
        raise SystemExit("run it as one process (no launcher)")
    g = torch.Generator().manual_seed(0)
    data = torch.randn(32, 3, 32, 32, generator=g)
    target = torch.randint(0, 10, (32,), generator=g)
    runs = {"plain": make(False), "DistributedOptimizer": make(True)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for block in range(blocks):
        order = list(runs.items()) if block % 2 else list(runs.items())[::-1]
        for name, (model, opt) in order:
            for _ in range(STEPS_PER_BLOCK):
                start = time.perf_counter()
                opt.zero_grad()
                F.cross_entropy(model(data), target).backward()
                opt.step()
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t[STEPS_PER_BLOCK:]) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:22s} {median * 1e3:8.3f} ms/step")
    print(f"ratio {medians['DistributedOptimizer'] / medians['plain']:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
