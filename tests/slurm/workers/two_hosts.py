"""Runs on every task of ``srun -N 2 --ntasks-per-node=2`` on the test cluster's two hosts:
the topology from the hosts' distinct names, every collective, a DistributedOptimizer step, and
process sets that span the hosts. Each check that passes prints ``rank R: <check> ok``; the
first that fails raises, which ends the job.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import torch
from mpi4py import MPI

import hpc_horovod.torch as hvd
from hpc_horovod.common.topology import detect

LAUNCHED = detect().size  # process sets are declared before init
ACROSS = [hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])]  # one rank of each host in each
hvd.init(process_sets=ACROSS)
torch.set_num_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()


def ok(check: str) -> None:
    print(f"rank {RANK}: {check} ok", flush=True)


def check_topology() -> None:
    """local_* and cross_* group the ranks by hostname, as the hosts themselves say it."""
    me = socket.gethostname()
    assert me == os.environ["SLURMD_NODENAME"], (me, os.environ["SLURMD_NODENAME"])
    names = hvd.allgather_object(me)
    assert names == ["h1", "h1", "h2", "h2"], names
    hosts = list(dict.fromkeys(names))
    assert hvd.cross_size() == len(hosts), (hvd.cross_size(), hosts)
    assert hvd.cross_rank() == hosts.index(me), (hvd.cross_rank(), hosts)
    assert hvd.local_size() == names.count(me), (hvd.local_size(), names)
    assert hvd.local_rank() == names[:RANK].count(me), (hvd.local_rank(), names)
    assert hvd.is_homogeneous()
    # Open MPI groups the same ranks by shared memory: ranks of one host share a window, and
    # each reads what its neighbour wrote there
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    assert local.Get_size() == hvd.local_size(), (local.Get_size(), hvd.local_size())
    window = MPI.Win.Allocate_shared(8, 8, comm=local)
    mine = np.ndarray((1,), np.int64, buffer=window.tomemory())
    window.Fence()
    mine[0] = RANK
    window.Fence()
    other = 1 - local.Get_rank()
    buffer, _ = window.Shared_query(other)
    theirs = int(np.ndarray((1,), np.int64, buffer=buffer)[0])
    assert names[theirs] == me and theirs != RANK, (theirs, names)
    window.Fence()
    window.Free()
    local.Free()
    ok("topology")


def check_allreduce() -> None:
    for dtype in (torch.float32, torch.float64, torch.float16, torch.int32):
        value = torch.full((1000,), RANK + 1, dtype=dtype)
        total = hvd.allreduce(value, op=hvd.Sum, name=f"sum.{dtype}")
        assert total.dtype == dtype and (total == 10).all(), (dtype, total[:4])
        if dtype.is_floating_point:
            mean = hvd.allreduce(value, op=hvd.Average, name=f"avg.{dtype}")
            assert mean.dtype == dtype and (mean == 2.5).all(), (dtype, mean[:4])
    halves = torch.full((7,), 0.25 * (RANK + 1), dtype=torch.float16)
    hvd.allreduce_(halves, op=hvd.Average, name="avg.inplace.f16")
    assert (halves == 0.625).all(), halves
    ok("allreduce")


def check_allgather() -> None:
    rows = torch.full((RANK + 1, 3), float(RANK))  # uneven first dimensions
    gathered = hvd.allgather(rows, name="gather.uneven")
    assert gathered.shape == (10, 3), gathered.shape
    assert gathered[:, 0].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0]
    assert hvd.allgather(torch.zeros(0, 3) if RANK == 1 else torch.ones(2, 3),
                         name="gather.empty").shape == (6, 3)
    ok("allgather")


def check_broadcast() -> None:
    for root in range(SIZE):  # from either host
        got = hvd.broadcast(torch.arange(5) + 10 * RANK, root_rank=root, name=f"bcast.{root}")
        assert got.tolist() == [10 * root + i for i in range(5)], (root, got)
    state = {"w": torch.full((3,), float(RANK))}
    hvd.broadcast_parameters(state, root_rank=3)
    assert state["w"].tolist() == [3.0] * 3
    assert hvd.broadcast_object({"from": RANK}, root_rank=2) == {"from": 2}
    ok("broadcast")


def check_alltoall() -> None:
    # rank r sends j + 1 rows to rank j, each row holding (r, j)
    splits = torch.tensor([j + 1 for j in range(SIZE)])
    rows = torch.tensor([[RANK, j] for j in range(SIZE) for _ in range(j + 1)])
    received, received_splits = hvd.alltoall(rows, splits=splits, name="a2a.uneven")
    assert received_splits.tolist() == [RANK + 1] * SIZE, received_splits
    assert received.tolist() == [[r, RANK] for r in range(SIZE) for _ in range(RANK + 1)]
    even = hvd.alltoall(torch.arange(SIZE) + 100 * RANK, name="a2a.even")
    assert even.tolist() == [100 * r + RANK for r in range(SIZE)], even
    ok("alltoall")


def check_reducescatter() -> None:
    data = torch.arange(2 * SIZE * 3, dtype=torch.float32).reshape(2 * SIZE, 3) * (RANK + 1)
    part = hvd.reducescatter(data, op=hvd.Sum, name="rs.sum")
    expected = torch.arange(2 * SIZE * 3, dtype=torch.float32).reshape(2 * SIZE, 3)[
        2 * RANK:2 * RANK + 2] * 10
    assert torch.equal(part, expected), (part, expected)
    mean = hvd.reducescatter(torch.ones(SIZE + 1, 2), name="rs.avg")  # uneven: 2, 1, 1, 1 rows
    assert mean.shape == (2 if RANK == 0 else 1, 2) and (mean == 1).all(), mean
    ok("reducescatter")


def check_barrier() -> None:
    # the ranks of h2 arrive late: nobody leaves the barrier before they have arrived (the
    # hosts share this machine's clock)
    if socket.gethostname() == "h2":
        time.sleep(1.0)
    arrived = time.time()
    hvd.barrier()
    left = time.time()
    times = hvd.allgather_object((arrived, left))
    assert min(t[1] for t in times) >= max(t[0] for t in times), times
    ok("barrier")


def check_join() -> None:
    # rank r has r + 2 batches; joined ranks contribute zeros
    for step in range(RANK + 2):
        active = [r for r in range(SIZE) if r + 2 > step]
        got = hvd.allreduce(torch.full((4,), RANK + 1.0), op=hvd.Sum, name=f"join.{step}")
        assert got.tolist() == [float(sum(r + 1 for r in active))] * 4, (step, got)
    last = hvd.join()
    assert last == SIZE - 1, last
    ok("join")


def check_optimizer() -> None:
    """One DistributedOptimizer step on different data: the same averaged gradient, so the same
    parameters, on every rank, and the ones a single process gets from all the data."""
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if RANK != 0:  # rank 0's initial parameters win
        for p in model.parameters():
            p.data.normal_()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    reference.load_state_dict(model.state_dict())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    generator = torch.Generator().manual_seed(99)
    data = [(torch.randn(5, 6, generator=generator), torch.randn(5, 2, generator=generator))
            for _ in range(SIZE)]
    x, y = data[RANK]
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="optimizer.params")
    assert all(torch.equal(everyone[r], flat) for r in range(SIZE)), everyone
    # a single process over all the data: the mean of the per-rank losses' gradients
    single = torch.optim.SGD(reference.parameters(), lr=0.1)
    single.zero_grad()
    loss = sum(torch.nn.functional.mse_loss(reference(xr), yr) for xr, yr in data) / SIZE
    loss.backward()
    single.step()
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(flat, expected, rtol=1e-5, atol=1e-6)
    ok("optimizer")


def check_process_sets() -> None:
    mine = ACROSS[RANK % 2]
    members = mine.ranks
    assert mine.included() and mine.size() == 2 and mine.rank() == members.index(RANK)
    hosts = hvd.allgather_object(socket.gethostname(), process_set=mine)
    assert hosts == ["h1", "h2"], hosts
    total = hvd.allreduce(torch.full((3,), float(RANK)), op=hvd.Sum, process_set=mine,
                          name="ps.sum")
    assert total.tolist() == [float(sum(members))] * 3, total
    gathered = hvd.allgather(torch.full((RANK + 1,), RANK), process_set=mine, name="ps.gather")
    assert gathered.tolist() == sum([[r] * (r + 1) for r in members], []), gathered
    root = members[1]  # a global rank, on h2
    got = hvd.broadcast(torch.full((2,), RANK), root_rank=root, process_set=mine,
                        name="ps.bcast")
    assert got.tolist() == [root] * 2, got
    hvd.barrier(process_set=mine)
    # both sets at once, and the global set next to them under the same name
    in_set = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, process_set=mine, name="ps.both")
    in_all = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="ps.both")
    assert hvd.synchronize(in_set).tolist() == [2.0, 2.0]
    assert hvd.synchronize(in_all).tolist() == [4.0, 4.0]
    ok("process sets")


assert SIZE == LAUNCHED == 4, (SIZE, LAUNCHED)
for check in (check_topology, check_allreduce, check_allgather, check_broadcast,
              check_alltoall, check_reducescatter, check_barrier, check_join, check_optimizer,
              check_process_sets):
    check()
hvd.shutdown()
ok("shutdown")
