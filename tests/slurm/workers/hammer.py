"""Hammers the engine's in-node and cross-node paths at once: ``argv[1]`` steps, each of which
submits a random subset of named tensors asynchronously, in an order of its own on every rank,
with random pauses between submissions and before the waits (a rank that is late, one that is
early, one that stops for a while), then waits for them in another order. The sizes cover every
path of the hierarchical backend: below its threshold (MPI's allreduce over every rank), one
chunk through the node's window with the slice allreduced across nodes, several chunks, small
tensors fused into the window's staging half, in place and out of place; each step ends with a
synchronous allreduce, and every few steps a broadcast and an allgather. ``argv[2]`` seeds the
ranks' pauses (each rank its own); the subset of tensors is the same on every rank.

Every result is checked exactly (integers in float32); a wrong one raises, which ends the job.
Rank 0 prints ``hammer ok: S steps`` at the end.
"""

from __future__ import annotations

import random
import sys
import time

import numpy as np

import hpc_horovod as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
STEPS, SEED = int(sys.argv[1]), int(sys.argv[2])
#: elements of float32: MPI's allreduce; the window in one chunk; in several; fused smalls
SIZES = {"mpi": 20_000, "window": 100_000, "chunks": 700_000, "small.0": 300, "small.1": 500,
         "small.2": 4_000}
pauses = random.Random(SEED * 7919 + RANK)
shared = random.Random(SEED)  # the same draws on every rank


def pause() -> None:
    """Mostly nothing, sometimes a little, now and then long enough to be the last by far."""
    draw = pauses.random()
    if draw < 0.5:
        return
    time.sleep(0.002 * pauses.random() if draw < 0.95 else 0.05 * pauses.random())


def expected(step: int, k: int) -> float:
    return float(SIZE * (SIZE + 1) // 2 + SIZE * (step + k))


for step in range(STEPS):
    names = [name for name in SIZES if shared.random() < 0.8] or ["mpi"]
    order = names[:]
    pauses.shuffle(order)
    handles, inputs = {}, {}
    for name in order:
        pause()
        tensor = np.full(SIZES[name], RANK + 1 + step + names.index(name), np.float32)
        inputs[name] = tensor
        if names.index(name) % 2:
            handles[name] = hvd.allreduce_async_(tensor, op=hvd.Sum, name=f"hammer.{name}")
        else:
            handles[name] = hvd.allreduce_async(tensor, op=hvd.Sum, name=f"hammer.{name}")
    pause()
    pauses.shuffle(order)
    for name in order:
        result = hvd.synchronize(handles[name])
        want = expected(step, names.index(name))
        if result.shape != inputs[name].shape or not (result == want).all():
            raise AssertionError(f"rank {RANK} step {step} {name}: {result[:4]} != {want}")
    total = hvd.allreduce(np.full(3, float(step), np.float32), op=hvd.Sum, name="hammer.sync")
    assert (total == SIZE * step).all(), (step, total)
    if step % 5 == 0:
        root = step % SIZE
        got = hvd.broadcast(np.full(2, RANK * 100 + step), root_rank=root, name="hammer.bcast")
        assert got.tolist() == [root * 100 + step] * 2, (step, got)
        rows = hvd.allgather(np.full((RANK % 3 + 1, 2), RANK), name="hammer.gather")
        assert rows.shape[0] == sum(r % 3 + 1 for r in range(SIZE)), rows.shape
hvd.shutdown()
if RANK == 0:
    print(f"hammer ok: {STEPS} steps", flush=True)
