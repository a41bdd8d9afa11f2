"""The engine's cycles run on whichever thread holds the cycle lock: its own, or a caller blocked in
``wait``. These tests build an engine whose thread is never started, so every cycle that happens
is one a waiter ran; a failure inside such a cycle must end the engine as one in its thread would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from hpc_horovod.backends.single import SingleBackend
from hpc_horovod.common import patience
from hpc_horovod.common.config import Settings
from hpc_horovod.common.engine import IDLE_MAX_S, Engine
from hpc_horovod.common.errors import HorovodInternalError
from hpc_horovod.common.request import Request, signature_of
from hpc_horovod.common.types import Sum

pytestmark = pytest.mark.timeout(60)  # a regression here hangs rather than fails


def allreduce(name: str, x: np.ndarray, output=None) -> Request:
    return Request(name, x, signature_of("allreduce", x, Sum), 0, output)


class FailingBackend(SingleBackend):
    """Raises ``exc`` from the data reduction (not from the negotiation)."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def allreduce(self, buf, op, send=None, prescale=1.0, postscale=1.0):
        raise self.exc


def test_a_waiter_runs_the_cycles_the_idle_engine_thread_would():
    engine = Engine(SingleBackend(), Settings())  # no engine thread
    xs = [np.arange(n, dtype=np.float32) for n in (3, 5, 7)]
    handles = engine.enqueue([allreduce(f"t{i}", x) for i, x in enumerate(xs)])
    inplace = np.ones(4)
    handles.append(engine.submit(allreduce("in", inplace, output=inplace)))
    for handle, x in zip(handles, xs):
        np.testing.assert_array_equal(engine.wait(handle).result, x)
    assert engine.wait(handles[-1]).result is inplace
    assert engine.cycles >= 1 and not engine.queued


def test_concurrent_waiters_share_the_cycles():
    engine = Engine(SingleBackend(), Settings())
    results: dict[int, np.ndarray] = {}

    def submit_and_wait(t: int) -> None:
        for i in range(200):
            x = np.full(3, t * 1000 + i, np.float64)
            results[t * 1000 + i] = engine.wait(engine.submit(allreduce(f"{t}.{i}", x))).result

    threads = [threading.Thread(target=submit_and_wait, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 800
    assert all((value == key).all() for key, value in results.items())


@pytest.mark.parametrize("exc", [RuntimeError("MPI_ERR_TRUNCATE"), KeyboardInterrupt()],
                         ids=["error", "interrupt"])
def test_a_failure_in_a_waiters_cycle_stops_the_engine(exc):
    engine = Engine(FailingBackend(exc), Settings())
    first = engine.submit(allreduce("a", np.ones(2)))
    expected = HorovodInternalError if isinstance(exc, Exception) else KeyboardInterrupt
    with pytest.raises(expected):
        engine.wait(first)
    if expected is KeyboardInterrupt:  # the waiter's own interrupt reaches it; the request...
        with pytest.raises(HorovodInternalError, match="KeyboardInterrupt"):
            engine.wait(first)  # ...failed with the engine, as every later one does
    assert engine.error is not None and engine.stopped
    with pytest.raises(HorovodInternalError):
        engine.submit(allreduce("b", np.ones(2)))


# -- synchronous ops and the engine thread -----------------------------------------------------

@pytest.fixture
def slow_engine():
    """A started engine whose thread, once asleep, runs a timer cycle only every 30 s: whatever
    completes sooner was completed by a waiter or by a thread that was woken for it."""
    engine = Engine(SingleBackend(), Settings(cycle_time_ms=30_000))
    wakes = []
    engine.on_wake = lambda: wakes.append(threading.get_ident())
    engine.start()
    _wait_for(lambda: engine.asleep, "the engine thread to fall asleep")
    yield engine, wakes
    engine.shutdown()


def _wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="Linux scheduling policies")
def test_the_engine_thread_keeps_the_default_scheduling_policy(slow_engine):
    """No silent process-wide change: the engine's thread runs under the policy it inherited."""
    engine, _ = slow_engine
    assert os.sched_getscheduler(engine.thread.native_id) == os.sched_getscheduler(0)


def test_a_synchronous_op_leaves_the_engine_thread_asleep(slow_engine):
    engine, wakes = slow_engine
    x = np.arange(5.0)
    with engine.synchronous():
        handle = engine.submit(allreduce("sync", x))
        assert engine.asleep and not wakes
        np.testing.assert_array_equal(engine.wait(handle).result, x)
    assert not wakes  # nothing was left for the thread
    engine.submit(allreduce("async", x))  # an asynchronous op wakes it at once
    assert wakes == [threading.get_ident()]


def test_work_a_synchronous_op_leaves_behind_goes_to_the_engine_thread(slow_engine):
    engine, wakes = slow_engine
    with engine.synchronous():
        with engine.synchronous():  # nested: only the outermost exit hands over
            handle = engine.submit(allreduce("left", np.ones(3)))
        assert not wakes
    assert wakes
    _wait_for(lambda: engine.poll(handle), "the engine thread to complete the request")


def test_another_threads_submission_still_wakes_the_engine_thread(slow_engine):
    engine, wakes = slow_engine
    inside, leave = threading.Event(), threading.Event()

    def synchronous_caller() -> None:
        with engine.synchronous():
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=synchronous_caller)
    thread.start()
    try:
        inside.wait(10)
        handle = engine.submit(allreduce("other", np.ones(3)))
        _wait_for(lambda: engine.poll(handle), "the engine thread to complete the request")
        assert wakes == [threading.get_ident()]
    finally:
        leave.set()
        thread.join(10)


# -- a rank of one core: host work runs on the thread that waits for it -------------------------

def test_overlaps_follows_the_cpu_affinity():
    """``overlaps()`` in a child whose affinity is one core, then every core of this process."""
    cores = sorted(os.sched_getaffinity(0))
    code = ("import os, sys; from hpc_horovod.common.engine import overlaps; "
            "os.sched_setaffinity(0, {int(c) for c in sys.argv[1:]}); print(overlaps())")
    for chosen, expected in (([cores[0]], "False"), (cores, str(len(cores) > 1))):
        out = subprocess.run([sys.executable, "-c", code, *map(str, chosen)], check=True,
                             capture_output=True, text=True, timeout=60).stdout.strip()
        assert out == expected, (chosen, out)


def test_on_one_core_an_asynchronous_host_op_is_left_to_its_waiter(slow_engine):
    engine, wakes = slow_engine
    engine.overlaps = False
    x = np.arange(4.0)
    handle = engine.submit(allreduce("deferred", x))
    assert engine.asleep and not wakes and not engine.poll(handle)
    np.testing.assert_array_equal(engine.wait(handle).result, x)
    assert not wakes and engine.asleep  # nothing was left for the thread


def test_on_one_core_host_work_nobody_waits_for_moves_at_the_idle_pace():
    engine = Engine(SingleBackend(), Settings())
    engine.overlaps = False
    wakes = []
    engine.on_wake = lambda: wakes.append(1)
    engine.start()
    try:
        _wait_for(lambda: engine.asleep, "the engine thread to fall asleep")
        handle = engine.submit(allreduce("unwaited", np.ones(3)))
        _wait_for(lambda: engine.poll(handle), "a timer cycle to complete the request",
                  timeout_s=20 * IDLE_MAX_S)
        assert not wakes  # the thread's own timer, not the submission
    finally:
        engine.shutdown()


class _PatienceBackend(SingleBackend):
    """Records, for each cycle's negotiation, which thread ran it and whether it kept its core."""

    def __init__(self):
        super().__init__()
        self.negotiations = []

    def negotiate(self, words, timeout_s, alarm=None):
        self.negotiations.append((threading.current_thread().name, patience.keeps_core()))
        return super().negotiate(words, timeout_s, alarm)


def test_cycles_keep_the_core_while_a_caller_waits_and_not_in_the_background():
    backend = _PatienceBackend()
    engine = Engine(backend, Settings(cycle_time_ms=30_000))
    engine.start()
    try:
        me = threading.current_thread().name
        with engine.synchronous():
            engine.wait(engine.submit(allreduce("sync", np.ones(3))))
        assert backend.negotiations == [(me, True)]
        assert not patience.keeps_core()  # only while it waits
        handle = engine.submit(allreduce("async", np.ones(3)))
        _wait_for(lambda: engine.poll(handle), "the engine thread to complete the request")
        assert backend.negotiations[1] == ("hpc_horovod-engine", False)
    finally:
        engine.shutdown()


def test_an_engine_with_nothing_pending_backs_off_right_after_work():
    """Between a training step's ops the engine thread has nothing of its own: a peer's work
    cannot be ready before this rank submits it (and a submission wakes the thread), so it
    does not go back to a cycle every HOROVOD_CYCLE_TIME after each op, which would take the
    core from the training and make the peers' engines wait for it."""
    backend = _PatienceBackend()
    engine = Engine(backend, Settings(cycle_time_ms=1))
    engine.start()
    try:
        time.sleep(0.2)  # backed off to the longest idle wait
        gaps, idle = 10, 0
        for i in range(gaps):
            handle = engine.submit(allreduce(f"op{i}", np.ones(3)))
            _wait_for(lambda h=handle: engine.poll(h), "the engine thread to complete it")
            done = len(backend.negotiations)
            time.sleep(0.02)  # a step's compute
            idle += len(backend.negotiations) - done
        # a cycle every HOROVOD_CYCLE_TIME, backing off from there, makes four or more a gap
        assert idle <= gaps // 2, f"{idle} idle cycles in {gaps} gaps of 20 ms after work"
    finally:
        engine.shutdown()
