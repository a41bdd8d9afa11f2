"""Runs on every task of ``srun -N 2 --ntasks-per-node=2`` (or ``=3``, or ``-N 2 -n 3``: 2 + 1
ranks) on the test cluster's two hosts, once with ``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` and once with
``=0``: the same allreduces of the same data, whose results each rank saves to
``<folder>/<label>.<rank>.npz`` for test_real_hosts.py to compare path against path.

    hierarchical_vs_flat.py FOLDER LABEL

Each rank checks first that the path asked for is the one that runs (the node's shared window,
by slice with equal nodes and through the nodes' leaders with unequal ones, or MPI alone), and
prints ``rank R: <check> done`` after each step. Sizes below and above the hierarchical path's
small-message threshold, in place and out of place; floats are positive (no cancellation, so
that the sum of magnitudes is the sum itself); then one DistributedOptimizer step whose buckets
lie in the window.
"""

from __future__ import annotations

import copy
import os
import sys

import numpy as np
import torch

import hpc_horovod.torch as hvd
from hpc_horovod.backends import hierarchical
from hpc_horovod.common import basics

FOLDER, LABEL = sys.argv[1], sys.argv[2]
HIERARCHICAL = os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "1"
DTYPES = [np.int32, np.int64, np.float32, np.float64]
#: bytes per rank: below the threshold, and above it over several chunks of the window (whose
#: halves test_real_hosts.py makes 8 MiB: the chunks of nodes of different sizes); odd counts
SIZES = {"below": hierarchical.MPI_BELOW_BYTES // 2 - 12,
         "above": max(10 * hierarchical.MPI_BELOW_BYTES, 20 << 20) + 24}

hvd.init()
torch.set_num_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()
BACKEND = basics.engine().backend
saved: dict[str, np.ndarray] = {}


def done(check: str) -> None:
    print(f"rank {RANK}: {check} done", flush=True)


def values(dtype, nbytes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * seed + RANK)
    count = nbytes // np.dtype(dtype).itemsize
    if np.dtype(dtype).kind == "i":
        return rng.integers(-(1 << 20), 1 << 20, count, dtype=dtype)
    return (0.5 + rng.random(count)).astype(dtype)


def check_path() -> None:
    hosts = hvd.allgather_object(os.environ["SLURMD_NODENAME"])
    even = SIZE % 2 == 0  # SIZE // 2 ranks on each host, else one more on h1
    assert hosts == ["h1"] * (SIZE - SIZE // 2) + ["h2"] * (SIZE // 2), hosts
    if HIERARCHICAL:
        assert isinstance(BACKEND, hierarchical.HierarchicalBackend), type(BACKEND)
        assert BACKEND.cross_size == 2 and BACKEND.by_slice == even, (
            BACKEND.cross_size, BACKEND.by_slice)
        # several chunks of the window above the threshold
        assert BACKEND.window.staging_bytes < SIZES["above"], BACKEND.window.staging_bytes
    else:
        assert not isinstance(BACKEND, hierarchical.HierarchicalBackend), type(BACKEND)
    done("path")


def check_sums(size: str, in_place: bool) -> None:
    for seed, dtype in enumerate(DTYPES):
        x = values(dtype, SIZES[size], seed)
        name = f"{size}.{'ip' if in_place else 'oop'}.{np.dtype(dtype).name}"
        if in_place:
            seq = getattr(BACKEND, "window", None) and BACKEND.window.seq
            hvd.allreduce_(torch.from_numpy(x), op=hvd.Sum, name=name)
            if HIERARCHICAL:  # the window's stages ran above the threshold only
                assert (BACKEND.window.seq > seq) == (size == "above"), (name, seq)
            result = x
        else:
            kept = x.copy()
            result = hvd.allreduce(torch.from_numpy(x), op=hvd.Sum, name=name).numpy()
            assert np.array_equal(x, kept), name  # the input is left alone
        saved[name] = result.copy()
    done(f"{size} {'in place' if in_place else 'out of place'}")


def check_optimizer() -> None:
    """One step of a model whose two buckets (first of 1 MiB, then the rest) are above the
    threshold: in the window on the hierarchical path, reduced there by the stages."""
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.Tanh(),
                                torch.nn.Linear(2048, 512))
    alone = copy.deepcopy(model)  # this rank's own gradients, for the test's bounds
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    generator = torch.Generator().manual_seed(99 + RANK)
    x, y = torch.randn(8, 256, generator=generator), torch.randn(8, 512, generator=generator)
    torch.nn.functional.mse_loss(alone(x), y).backward()
    for name, p in alone.named_parameters():
        saved[f"local.{name}"] = p.grad.numpy().copy()
    optimizer.zero_grad()
    # before backward: the buckets' reductions may be over before synchronize() is called
    seq = getattr(BACKEND, "window", None) and BACKEND.window.seq
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.synchronize()
    for bucket in optimizer._buckets:
        assert bucket.flat.nbytes >= hierarchical.MPI_BELOW_BYTES, bucket.flat.nbytes
        if HIERARCHICAL:
            assert BACKEND.window.offset_of(bucket.flat.numpy()) is not None, bucket.name
    if HIERARCHICAL:
        assert BACKEND.window.seq > seq, seq
    for name, p in model.named_parameters():
        saved[f"grad.{name}"] = p.grad.numpy().copy()
    with optimizer.skip_synchronize():
        optimizer.step()
    for name, p in model.named_parameters():
        saved[f"param.{name}"] = p.detach().numpy().copy()
    done("optimizer")


check_path()
for size in SIZES:
    for in_place in (True, False):
        check_sums(size, in_place)
check_optimizer()
np.savez(os.path.join(FOLDER, f"{LABEL}.{RANK}.npz"), **saved)
hvd.shutdown()
done("shutdown")
