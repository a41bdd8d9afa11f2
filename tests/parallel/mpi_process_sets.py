"""Run by every rank of ``mpirun -np N python -m pytest`` (test_ops.py), with
HOROVOD_DYNAMIC_PROCESS_SETS=1: static process sets
(``init(process_sets=...)``), dynamic ones (``add_process_set``/``remove_process_set``), ops on a
subset while the other ranks idle, and init -> shutdown -> init with sets. Root ranks are global
ranks, as in Horovod. Prints ``rank R: process sets ok``."""

from __future__ import annotations

import time

import numpy as np
import pytest

import hpc_horovod as hvd
from hpc_horovod.common.topology import detect

JOB = detect()  # the sets must exist before init
RANK, SIZE = JOB.rank, max(JOB.size, 2)  # (a process alone only collects the checks)
even = hvd.ProcessSet(range(0, SIZE, 2))
odd = hvd.ProcessSet(range(1, SIZE, 2))
mine = even if RANK % 2 == 0 else odd
other = odd if mine is even else even


@pytest.fixture(autouse=True)
def _job():
    hvd.init(process_sets=[even, odd])  # a new engine after a check that stopped it


def test_static_sets():
    assert even.process_set_id != odd.process_set_id and 0 not in (even.process_set_id,
                                                                   odd.process_set_id)
    assert mine.included() and not other.included()
    assert mine.rank() == mine.ranks.index(RANK) and other.rank() == -1
    assert mine.size() == len(mine.ranks)
    members = mine.ranks
    for step in range(20):
        got = hvd.allreduce(np.full(3, RANK + step, np.float64), op=hvd.Sum, process_set=mine,
                            name=f"ps.sum.{step}")
        assert got.tolist() == [float(sum(r + step for r in members))] * 3
    avg = hvd.allreduce(np.full(2, float(RANK)), process_set=mine)
    np.testing.assert_allclose(avg, sum(members) / len(members))
    gathered = hvd.allgather(np.full((RANK + 1, 2), RANK), process_set=mine)
    assert gathered[:, 0].tolist() == sum([[r] * (r + 1) for r in members], [])
    for root in members:  # a global rank
        got = hvd.broadcast(np.full(4, RANK, np.int32), root_rank=root, process_set=mine)
        assert got.tolist() == [root] * 4
        assert hvd.broadcast_object({"from": RANK}, root_rank=root,
                                    process_set=mine) == {"from": root}
    received, splits = hvd.alltoall(np.full(len(members), RANK), process_set=mine)
    assert received.tolist() == members and splits.tolist() == [1] * len(members)
    rows = 2 * len(members) + 1
    scattered = hvd.reducescatter(np.ones((rows, 2), np.float32), op=hvd.Sum, process_set=mine)
    assert (scattered == len(members)).all()
    hvd.barrier(process_set=mine)
    assert hvd.allgather_object(RANK, process_set=mine) == members
    # a root outside the set is refused before anything moves
    outsider = other.ranks[0]
    try:
        hvd.broadcast(np.ones(1), root_rank=outsider, process_set=mine)
    except ValueError as exc:
        assert f"root rank {outsider} is not a member" in str(exc)
    else:
        raise AssertionError("broadcast from a rank outside the set was accepted")
    # an op on a set this rank is not part of fails on this rank only
    try:
        hvd.allreduce(np.ones(1), process_set=other, name="not.mine")
    except ValueError as exc:
        assert f"not a member of process set {other.process_set_id}" in str(exc)
    else:
        raise AssertionError("an op on a foreign process set was accepted")


def test_subset_while_others_idle():
    if RANK % 2 == 0:
        for step in range(50):
            got = hvd.allreduce(np.ones(1000, np.float32), op=hvd.Sum, process_set=even,
                                name=f"busy.{step}")
            assert got[0] == len(even.ranks)
    else:
        time.sleep(0.3)  # the odd ranks idle: the even set must not need them
    # both sets at the same time, and the global set on top
    h_mine = hvd.allreduce_async(np.full(2, 1.0), op=hvd.Sum, process_set=mine, name="both")
    h_all = hvd.allreduce_async(np.full(2, 1.0), op=hvd.Sum, name="both")  # same name, other set
    assert hvd.synchronize(h_mine).tolist() == [len(mine.ranks)] * 2
    assert hvd.synchronize(h_all).tolist() == [SIZE] * 2


def test_mismatch_inside_a_set():
    members = even.ranks
    if RANK % 2 or len(members) < 2:
        return
    dtype = np.float32 if RANK == members[0] else np.float64
    try:
        hvd.allreduce(np.ones(2, dtype), process_set=even, name="ps.bad")
    except hvd.HorovodInternalError as exc:
        assert str(exc).startswith("Mismatched data types: One rank had type float32, but "
                                   "another rank had type float64."), str(exc)
    else:
        raise AssertionError("mismatch inside a process set not reported")
    assert hvd.allreduce(np.ones(2), op=hvd.Sum, process_set=even).tolist() == [len(members)] * 2


def test_dynamic_sets():
    if SIZE > 2:  # every rank must add the same set (with 2 ranks, [0, 1] is the only new one)
        try:
            hvd.add_process_set([0, 1] if RANK == 0 else [1, 2])
        except hvd.HorovodInternalError as exc:
            message = str(exc)
            assert message.startswith("Mismatched process sets: One rank added a process set "
                                      "of ranks [0, 1], but another rank added ranks [1, 2]."), \
                message
            assert hvd.allgather_object(message) == [message] * SIZE
        else:
            raise AssertionError("ranks added different process sets without an error")
    first_two = hvd.add_process_set([0, 1])
    assert first_two.process_set_id not in (0, even.process_set_id, odd.process_set_id)
    tail = hvd.add_process_set(hvd.ProcessSet(range(1, SIZE))) if SIZE > 2 else None
    if RANK in (0, 1):
        got = hvd.allreduce(np.array([RANK + 1.0]), op=hvd.Sum, process_set=first_two)
        assert got.tolist() == [3.0]
        assert hvd.broadcast(np.array([RANK]), root_rank=1, process_set=first_two).tolist() == [1]
    if tail is not None and RANK > 0:
        got = hvd.allreduce(np.array([float(RANK)]), op=hvd.Sum, process_set=tail)
        assert got.tolist() == [float(sum(range(1, SIZE)))]
    try:
        hvd.add_process_set([1, 0])
    except ValueError as exc:
        assert "already exists" in str(exc)
    else:
        raise AssertionError("a second set with the same ranks was accepted")
    assert hvd.remove_process_set(first_two) is True
    assert first_two.process_set_id is None
    try:
        hvd.allreduce(np.ones(1), process_set=first_two)
    except ValueError as exc:
        assert "not registered" in str(exc)
    else:
        raise AssertionError("an op on a removed set was accepted")
    again = hvd.add_process_set([0, 1])  # the same ranks may be added again once removed
    if RANK in (0, 1):
        assert hvd.allgather(np.array([RANK]), process_set=again).tolist() == [0, 1]
    assert hvd.remove_process_set(again)
    assert tail is None or hvd.remove_process_set(tail)
    assert hvd.allreduce(np.ones(1), op=hvd.Sum).tolist() == [SIZE]


def test_reinit_with_sets():
    hvd.shutdown()
    assert even.process_set_id is None
    hvd.init(process_sets=[even, odd])
    assert (hvd.rank(), hvd.size()) == (RANK, SIZE)
    got = hvd.allreduce(np.ones(2), op=hvd.Sum, process_set=mine, name="ps.sum.0")
    assert got.tolist() == [len(mine.ranks)] * 2


def test_init_with_a_communicator():
    """``init(comm=...)``: an mpi4py communicator, or a list of world ranks, is the job."""
    from mpi4py import MPI

    hvd.shutdown()
    halves = MPI.COMM_WORLD.Split(color=RANK % 2, key=RANK)
    hvd.init(comm=halves)
    assert (hvd.rank(), hvd.size()) == (halves.Get_rank(), halves.Get_size())
    assert hvd.local_size() == hvd.size() and hvd.cross_size() == 1
    got = hvd.allreduce(np.array([RANK]), op=hvd.Sum)
    assert got.tolist() == [sum(r for r in range(SIZE) if r % 2 == RANK % 2)]
    hvd.shutdown()
    halves.Free()
    try:
        hvd.init(comm=[0, 1])
    except ValueError as exc:
        assert RANK > 1 and "this rank is not in the ranks [0, 1] given to init()" in str(exc)
    else:
        assert RANK in (0, 1) and hvd.size() == 2
        assert hvd.allgather(np.array([RANK])).tolist() == [0, 1]
        hvd.shutdown()
    hvd.init(process_sets=[even, odd])
    assert hvd.size() == SIZE


