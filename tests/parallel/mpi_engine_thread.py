"""Run by every rank of ``mpirun -np N python -m pytest`` (test_engine_thread.py): who runs the
engine's cycles while a caller waits for a peer that comes late. The waiting caller runs them,
the engine thread leaves them to it (a cycle of its own would only make the caller wait for the
lock), and another thread's asynchronous op still moves meanwhile, through the caller's cycles
on this rank and the engine thread's on the late one."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import hpc_horovod as hvd
from hpc_horovod.common import basics
from hpc_horovod.common import engine as engine_module

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
LATE = SIZE - 1
DELAY_S = 0.5


@pytest.fixture
def on_thread():
    """Times at which the engine thread itself ran a cycle (a spy on the real method)."""
    hvd.init()
    engine = basics.engine()
    times = count_engine_thread_cycles(engine)
    yield times
    engine.on_cycle = None


def count_engine_thread_cycles(engine) -> list[float]:
    """Times at which the engine thread itself ran a cycle (the engine's ``on_cycle``)."""
    times: list[float] = []

    def counted() -> None:
        if threading.current_thread() is engine.thread:
            times.append(time.monotonic())

    engine.on_cycle = counted
    return times


def test_the_waiting_caller_runs_the_cycles(on_thread: list[float]) -> None:
    for variant, submit in enumerate((hvd.allreduce_, lambda x, name, op: hvd.synchronize(
            hvd.allreduce_async_(x, name=name, op=op)))):  # the async one wakes the thread
        COMM.Barrier()
        if RANK == LATE:
            time.sleep(DELAY_S)
        before, start = len(on_thread), time.monotonic()
        x = np.full(10, RANK + 1.0)
        submit(x, name=f"late{variant}", op=hvd.Sum)
        assert np.all(x == SIZE * (SIZE + 1) / 2)
        if RANK != LATE:
            waited = time.monotonic() - start
            ran = len(on_thread) - before
            # about one negotiation per ms for DELAY_S: the caller ran them, not the thread
            assert waited > DELAY_S / 2 and ran <= 3, f"{ran} engine thread cycles in {waited}s"


def test_another_threads_op_moves_meanwhile() -> None:
    hvd.init()
    COMM.Barrier()
    side_done = threading.Event()

    def side() -> None:
        y = np.full(5, RANK + 1.0)
        handle = hvd.allreduce_async_(y, name="side", op=hvd.Sum)
        while not hvd.poll(handle):
            time.sleep(0.001)
        hvd.synchronize(handle)
        assert np.all(y == SIZE * (SIZE + 1) / 2)
        side_done.set()

    if RANK == LATE:
        threading.Thread(target=side).start()
        assert side_done.wait(30), "the side op never completed on the late rank"
        time.sleep(DELAY_S)
    x = np.ones(3)
    thread = None
    if RANK != LATE:
        thread = threading.Thread(target=side)
        thread.start()
    hvd.allreduce_(x, name="main", op=hvd.Sum)  # the late rank submits it after DELAY_S
    if thread is not None:
        assert side_done.is_set(), "the side op waited for the caller's own op"
        thread.join(30)
    assert np.all(x == SIZE)


def test_synchronous_ops_leave_the_engine_thread_backed_off(on_thread: list[float]) -> None:
    """Between synchronous ops the rank does other work (here a sleep), with nothing pending:
    the engine thread then backs off to a timer cycle every ``IDLE_MAX_S``, counted from the
    rank's last cycle, whichever thread ran it. So while the caller's own op cycles come more
    often than that, as a training loop's steps do, the thread runs none: a timer cycle in a
    gap would take the place of a peer's op cycle (one more round of negotiation for the op),
    and one still running when the caller comes to wait makes it queue for the lock. A cycle
    of its own that an op's submission meets must not reset the pace either (the op is the
    caller's to run)."""
    ops, gap_s = 150, 0.005
    x = np.ones(1024)
    hvd.allreduce_(x, name="warm", op=hvd.Sum)
    COMM.Barrier()
    before, ends = len(on_thread), [time.monotonic()]
    for _ in range(ops):
        time.sleep(gap_s)
        COMM.Barrier()
        x[...] = RANK + 1.0
        hvd.allreduce_(x, name="gap", op=hvd.Sum)
        ends.append(time.monotonic())
        assert np.all(x == SIZE * (SIZE + 1) / 2)
    ran = len(on_thread) - before
    # the timer's cycles as it backs off from HOROVOD_CYCLE_TIME (1, 2, 4, .. 32 ms) to
    # IDLE_MAX_S, and one per IDLE_MAX_S of the gaps that a loaded machine made that long
    idle = engine_module.IDLE_MAX_S
    late = sum(int((b - a) / idle) for a, b in zip(ends, ends[1:]))
    allowed = 6 + late
    assert ran <= allowed, (f"the engine thread ran {ran} cycles in {ops} gaps between "
                            f"synchronous ops ({ends[-1] - ends[0]:.2f} s; {allowed} allowed, "
                            f"{late} of them for gaps of {idle} s or more)")


def test_the_binding_decides_whether_host_work_overlaps() -> None:
    """A rank bound to one core (``HVD_TEST_ONE_CORE``) runs its host work on the thread that
    waits for it: an asynchronous submission leaves the engine thread as it is, and the
    result is the same."""
    hvd.init()
    engine = basics.engine()
    one_core = len(os.sched_getaffinity(0)) == 1
    assert engine.overlaps is not one_core
    assert one_core is bool(os.environ.get("HVD_TEST_ONE_CORE"))
    wakes: list[int] = []
    engine.on_wake = lambda: wakes.append(1)
    try:
        for n in (10, 1 << 17):  # through MPI, and through the node's window
            x = np.full(n, RANK + 1.0)
            COMM.Barrier()
            _wait_until_asleep(engine)
            handle = hvd.allreduce_async_(x, name=f"overlap.{n}", op=hvd.Sum)
            if one_core:
                assert not wakes, "a host submission woke the engine thread of a one-core rank"
            hvd.synchronize(handle)
            assert np.all(x == SIZE * (SIZE + 1) / 2)
    finally:
        engine.on_wake = None


def _wait_until_asleep(engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not engine.asleep:
        assert time.monotonic() < deadline, "the engine thread never fell asleep"
        time.sleep(0.001)
