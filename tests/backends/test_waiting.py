"""Polling a non-blocking MPI request (backends/waiting.py), on real requests of this process."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from hpc_horovod.backends import waiting  # noqa: E402
from hpc_horovod.common import patience  # noqa: E402
from hpc_horovod.common.errors import HorovodInternalError  # noqa: E402


def test_a_request_that_never_completes_is_reported_and_kept_alive():
    """An Irecv nobody sends to: after the timeout the error names what was waited for, and the
    request (which holds its receive buffer) stays referenced, since a late peer would still
    complete it and MPI would write into that buffer."""
    buf = np.zeros(4, np.int64)
    req = MPI.COMM_SELF.Irecv(buf, source=0, tag=77)
    try:
        with pytest.raises(HorovodInternalError,
                           match=r"no answer from some of the 3 ranks for 0 s \(the table\)"):
            waiting.RequestWaiter(3).wait(req, 0.05, "the table")
        assert any(kept is req for kept in waiting.abandoned)
    finally:
        req.Cancel()
        req.Wait()
        waiting.abandoned.remove(req)


def test_a_completed_request_returns_at_once():
    buf = np.zeros(1, np.int64)
    recv = MPI.COMM_SELF.Irecv(buf, source=0, tag=78)
    MPI.COMM_SELF.Send(np.array([5], np.int64), dest=0, tag=78)
    waiting.RequestWaiter(1).wait(recv, 0.05, "a message")
    assert buf[0] == 5


class _LateRequest:
    """Completes after ``delay_s`` of wall time, like a peer's answer."""

    def __init__(self, delay_s: float):
        self._at = time.perf_counter() + delay_s

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return time.perf_counter() >= self._at


@pytest.mark.parametrize("caller", [True, False], ids=["a thread waits", "nobody waits"])
def test_waits_yield_the_core_while_a_thread_waits_and_sleep_otherwise(monkeypatch, caller):
    yields, sleeps = [], []
    monkeypatch.setattr(patience.os, "sched_yield", lambda: yields.append(1))
    sleep = time.sleep
    monkeypatch.setattr(waiting.time, "sleep", lambda s: (sleeps.append(s), sleep(s)))
    context = patience.waiting_caller if caller else contextlib.nullcontext()
    with context:
        waiting.RequestWaiter(2).wait(_LateRequest(0.005), 1.0, "a late peer")
    if caller:  # 5 ms is within the yielding time: no sleep at all
        assert yields and not sleeps
    else:
        assert sleeps and not yields
    assert not patience.keeps_core()


def test_a_wait_nobody_waits_for_sleeps_at_once(monkeypatch):
    """In the background the training computes on the same core: no spin before the first
    sleep (a spin there takes the core from it), only the one look that found the peer late."""
    request = _LateRequest(0.005)
    tests, looks_before_sleeping = request.Test, []

    def counted() -> bool:
        looks_before_sleeping.append(1)
        return tests()

    request.Test = counted
    sleep = time.sleep

    def first_sleep(s: float) -> None:
        looks_before_sleeping.append("sleep")
        sleep(s)

    monkeypatch.setattr(waiting.time, "sleep", first_sleep)
    waiting.RequestWaiter(2).wait(request, 1.0, "a late peer")
    assert looks_before_sleeping.index("sleep") == 2  # wait()'s look, then the loop's


class _CallerComesLate:
    """Completes at its ``done_at``-th look; at its ``caller_at``-th, a thread of the rank
    starts waiting for a result (as the training thread calls ``synchronize()`` while the
    engine thread waits for a bucket's peers)."""

    def __init__(self, caller_at: int, done_at: int):
        self.caller_at, self.done_at, self.looks = caller_at, done_at, 0

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        self.looks += 1
        if self.looks == self.caller_at:
            patience.waiting_caller.__enter__()
        return self.looks >= self.done_at


def test_a_background_wait_yields_from_the_moment_a_thread_waits_for_it(monkeypatch):
    """The pace follows whether a thread waits now, not whether one waited when the wait
    began: sleeping on would leave the core idle while the training thread waits."""
    pauses = []
    monkeypatch.setattr(patience.os, "sched_yield", lambda: pauses.append("yield"))
    monkeypatch.setattr(waiting.time, "sleep", lambda s: pauses.append("sleep"))
    request = _CallerComesLate(caller_at=4, done_at=8)
    try:
        waiting.RequestWaiter(2).wait(request, 1.0, "a late peer")
    finally:
        patience.waiting_caller.__exit__(None, None, None)
    # looks 1 (wait's own) and 2, 3 find nobody waiting: two sleeps between them; from the 4th
    # look on a thread waits: a yield after each look until the 8th completes
    assert pauses == ["sleep", "sleep", "yield", "yield", "yield", "yield"]
    assert not patience.keeps_core()


def test_a_caller_keeps_yielding_only_so_long(monkeypatch):
    monkeypatch.setattr(patience, "YIELD_S", 0.002)
    sleeps = []
    sleep = time.sleep
    monkeypatch.setattr(waiting.time, "sleep", lambda s: (sleeps.append(s), sleep(s)))
    with patience.waiting_caller:
        waiting.RequestWaiter(2).wait(_LateRequest(0.1), 1.0, "a late peer")
    assert sleeps  # after 2 ms of yielding it sleeps, as the engine thread does


def test_keeping_the_core_is_the_whole_ranks_while_any_thread_waits():
    """The engine thread runs cycles for a waiting caller too: what decides is that some thread
    of the rank waits, not which thread asks."""
    seen = []
    assert not patience.keeps_core()
    with patience.waiting_caller:
        other = threading.Thread(target=lambda: seen.append(patience.keeps_core()))
        other.start()
        other.join(10)
        with patience.waiting_caller:  # nested: another caller
            assert patience.keeps_core()
        assert patience.keeps_core()
    assert seen == [True]
    assert not patience.keeps_core()
