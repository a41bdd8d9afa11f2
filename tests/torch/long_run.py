"""A long run on every rank: ``argv[1]`` DistributedOptimizer steps in small gradient buckets
(the test sets ``HOROVOD_BUCKET_BYTES``), each rank on its own data; every 50 steps an allgather
of uneven rows, a broadcast from a rank that changes each time, and an allreduce on a process set
of half the ranks (the odd ones: on two hosts with the ranks in blocks, some on each) while the
others go on; then uneven ends: rank r runs 3 r steps more, and joins. Runs on any even number of
ranks, under ``mpirun`` or ``srun``.

Checked on every rank: every collective's result; after each step, every rank that ran it holds
the same parameters (after the first ranks joined, the others still agree: the joined ranks
contribute zeros to the same averaged gradients); ``join`` names the rank with the most steps;
and its parameters, broadcast, are then every rank's. Prints ``rank R: long run ok``.
"""

from __future__ import annotations

import hashlib
import sys

import torch

import hpc_horovod.torch as hvd
from hpc_horovod.common.topology import detect

WORLD = detect().size
assert WORLD >= 2 and WORLD % 2 == 0, f"run on an even number of ranks, not {WORLD}"
HALF = hvd.ProcessSet(list(range(1, WORLD, 2)))
hvd.init(process_sets=[HALF])
torch.set_num_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()
STEPS, EVERY = int(sys.argv[1]), 50


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def every_50_steps(step: int) -> None:
    rows = hvd.allgather(torch.full((RANK + 1, 2), float(step)), name="long.gather")
    assert rows.shape == (SIZE * (SIZE + 1) // 2, 2) and (rows == step).all(), (step, rows)
    root = step // EVERY % SIZE
    got = hvd.broadcast(torch.full((3,), RANK * 1000 + step), root_rank=root, name="long.bcast")
    assert got.tolist() == [root * 1000 + step] * 3, (step, root, got)
    if HALF.included():
        total = hvd.allreduce(torch.full((5,), float(RANK)), op=hvd.Sum, process_set=HALF,
                              name="long.half")
        assert total.tolist() == [float(sum(HALF.ranks))] * 5, (step, total)


torch.manual_seed(7)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                            torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                            torch.nn.Linear(32, 4))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                     named_parameters=model.named_parameters())
data = torch.Generator().manual_seed(RANK)
after_step = []
for step in range(STEPS + 3 * RANK):
    x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    after_step.append(digest(model))
    if step < STEPS and step % EVERY == 0:  # every rank still runs
        every_50_steps(step)
last = hvd.join()
assert last == SIZE - 1, last

histories = hvd.allgather_object(after_step)
for step in range(len(histories[last])):
    seen = {h[step] for h in histories if len(h) > step}
    assert len(seen) == 1, f"ranks disagree after step {step}: {seen}"
hvd.broadcast_parameters(model.state_dict(), root_rank=last)
final = hvd.allgather_object(digest(model))
assert final == [histories[last][-1]] * SIZE, final
print(f"rank {RANK}: long run ok ({len(after_step)} steps)", flush=True)
hvd.shutdown()
