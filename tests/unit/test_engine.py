"""The engine's cycles run on whichever thread holds the cycle lock: its own, or a caller blocked in
``wait``. These tests build an engine whose thread is never started, so every cycle that happens
is one a waiter ran; a failure inside such a cycle must end the engine as one in its thread would.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hpc_horovod.backends.single import SingleBackend
from hpc_horovod.common.config import Settings
from hpc_horovod.common.engine import Engine
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

    def allreduce(self, buf, op):
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
    assert engine._cycles >= 1 and not engine._queue


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
    assert engine.error is not None and engine._stopped
    with pytest.raises(HorovodInternalError):
        engine.submit(allreduce("b", np.ones(2)))
