"""Hierarchical allreduce on host buffers over real MPI, run on every rank of 4 (2 "nodes" of 2
ranks, grouped by node id as on fake SLURM nodes). The algorithm is the one the NCCL backend runs
with an NCCL node communicator; here the node step is MPI, so it runs without a GPU."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from hpc_horovod.backends.mpi import MpiBackend
from hpc_horovod.backends.nccl import CrossAllreduce, HierarchicalAllreduce, node_comms
from hpc_horovod.common.types import Max, Min, Product, Sum

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
assert size == 4, "run on 4 ranks"

local, cross = node_comms(comm, node_id=rank // 2)
assert (local.Get_size(), local.Get_rank()) == (2, rank % 2)
assert (cross.Get_size(), cross.Get_rank()) == (2, rank // 2)
hierarchical = HierarchicalAllreduce(MpiBackend(local), CrossAllreduce(MpiBackend(cross)))

FOLD = {Sum: np.add, Product: np.multiply, Min: np.minimum, Max: np.maximum}
CASES = [
    (np.float32, Sum), (np.float64, Sum), (np.float64, Product), (np.int32, Sum),
    (np.int64, Min), (np.int64, Max), (np.bool_, Min), (np.bool_, Max),
]
try:  # the MPI node step needs the native float16 sum; NCCL's has it built in
    from hpc_horovod import _native  # noqa: F401

    CASES.append((np.float16, Sum))
except ImportError:
    pass


def inputs(r: int, n: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(1000 * r + n)
    if dtype == np.bool_:
        return rng.random(n) < 0.7
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(n) + 1.5).astype(dtype)
    return rng.integers(-5, 6, n).astype(dtype)


for dtype, op in CASES:
    for n in (0, 1, 2, 3, 7, 1000, 1001):
        buf = inputs(rank, n, dtype).reshape(-1, 1) if n % 2 else inputs(rank, n, dtype)
        everyone = [inputs(r, n, dtype) for r in range(size)]
        if dtype == np.float16:  # reduced in float32 across nodes, in float16 within
            expected = FOLD[op].reduce(np.stack(everyone).astype(np.float32), axis=0)
        else:
            expected = FOLD[op].reduce(np.stack(everyone), axis=0)
        hierarchical(buf, op)
        assert buf.dtype == np.dtype(dtype) and buf.size == n
        got = buf.reshape(-1)
        if dtype == np.float16:
            np.testing.assert_allclose(got.astype(np.float32), expected, rtol=3e-3, atol=3e-3)
        elif np.dtype(dtype).kind == "f":
            np.testing.assert_allclose(got, expected, rtol=1e-6)
        else:
            np.testing.assert_array_equal(got, expected.astype(dtype))
        gathered = comm.allgather(got.tobytes())
        assert all(g == gathered[0] for g in gathered), (dtype, op, n)

local.Free()
cross.Free()

# Nodes with different rank counts cannot line shards up: no hierarchical communicators.
assert node_comms(comm, node_id=0 if rank < 3 else 1) is None
print(f"rank {rank}: hierarchical ok", flush=True)
