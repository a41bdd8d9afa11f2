"""An interrupted wait leaves nothing broken (issue 30 item 3), run by every rank of
``mpirun -np N python -m pytest`` (test_reinit.py). Rank 0 waits for an allreduce that the other
ranks submit late, and its wait is cut short: by a signal handler that raises, by a
KeyboardInterrupt (from a SIGINT handler), or as pytest-timeout does it (``pytest.fail`` from a
SIGALRM handler). Rank 0 sees what interrupted it, and its engine keeps working (an interrupt
that comes while this rank runs a cycle is held until the cycle ends: common/interrupts.py):
the others' late allreduce gives the right sum, or, when rank 0 shut down first, an error that
names it; ``shutdown()`` and ``init()`` work on every rank and a new allreduce gives the right
result. Each kind twice
in a row in one job; a crash (a segmentation fault) shows in the job's exit status, which the
driver checks."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import hpc_horovod as hvd
from hpc_horovod.common import basics

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
INTERRUPT_AFTER_S = 0.3
LATE_S = 1.5  # the others submit this long after rank 0
ANSWER_S = 30.0


class Interrupted(Exception):
    """What the raising signal handler raises."""


def _raise_interrupted(signum, frame):
    raise Interrupted("the wait was interrupted by a signal handler")


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt("SIGINT")


def _fail_like_pytest_timeout(signum, frame):
    pytest.fail(f"Timeout (>{INTERRUPT_AFTER_S}s) from pytest-timeout.")


#: kind -> (signal, handler, how it is sent, what it raises)
KINDS = {
    "raising-handler": (signal.SIGALRM, _raise_interrupted, "itimer", Interrupted),
    "keyboard-interrupt": (signal.SIGINT, _raise_keyboard_interrupt, "kill", KeyboardInterrupt),
    "pytest-timeout": (signal.SIGALRM, _fail_like_pytest_timeout, "itimer",
                       pytest.fail.Exception),
}


def _interrupted_wait(kind: str, tag: str) -> str:
    """Rank 0's allreduce, cut short after INTERRUPT_AFTER_S; returns what it raised."""
    signum, handler, how, raises = KINDS[kind]
    previous = signal.signal(signum, handler)
    timer = None
    if how == "itimer":  # pytest-timeout's own timer (SIGALRM) is put back afterwards
        start = time.monotonic()
        armed = signal.setitimer(signal.ITIMER_REAL, INTERRUPT_AFTER_S)
    else:
        timer = threading.Timer(INTERRUPT_AFTER_S, signal.raise_signal, (signum,))
        timer.start()
    try:
        hvd.allreduce(np.full(3, RANK + 1.0), op=hvd.Sum, name=f"late.{tag}")
    except BaseException as exc:  # noqa: BLE001 - what reaches the caller is the finding
        running = "running" if not basics.engine().stopped else "stopped"
        return f"{type(exc).__name__}: {exc} (engine {running})"
    else:
        return "not interrupted"
    finally:
        if timer is not None:
            timer.join()
        signal.signal(signum, previous)
        if how == "itimer":
            signal.setitimer(signal.ITIMER_REAL, 0)
            left = armed[0] - (time.monotonic() - start)
            if armed[0]:
                signal.setitimer(signal.ITIMER_REAL, max(left, 0.01))


def _late_allreduce(tag: str) -> str:
    """The others' allreduce, LATE_S after rank 0's; waited for ANSWER_S at most (then given up:
    every rank goes on to shutdown and init, whose collectives must meet)."""
    time.sleep(LATE_S)
    try:  # an engine that stopped meanwhile refuses the submission itself
        handle = hvd.allreduce_async(np.full(3, RANK + 1.0), op=hvd.Sum, name=f"late.{tag}")
        deadline = time.monotonic() + ANSWER_S
        while not hvd.poll(handle):
            if time.monotonic() > deadline:
                return f"no answer in {ANSWER_S} s: the engine neither completed it nor stopped"
            time.sleep(0.01)
        got = hvd.synchronize(handle)
    except hvd.HorovodInternalError as exc:
        return f"error: {exc}"
    return "sum" if got.tolist() == [SIZE * (SIZE + 1) / 2] * 3 else f"wrong: {got}"


def _interrupt_case(kind: str, attempt: int) -> None:
    hvd.init()  # a new engine after an attempt that stopped it
    MPI.COMM_WORLD.Barrier()
    tag = f"{kind}.{attempt}"
    outcome = _interrupted_wait(kind, tag) if RANK == 0 else _late_allreduce(tag)
    # whatever happened, shutdown() and init() work on every rank, and so does an allreduce
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init()
    got = hvd.allreduce(np.full(2, RANK + 1.0), op=hvd.Sum, name=f"after.{tag}")
    assert got.tolist() == [SIZE * (SIZE + 1) / 2] * 2, got
    outcomes = hvd.allgather_object(outcome)
    # the interrupted caller sees what interrupted it, and its engine still runs
    raised = KINDS[kind][3].__name__
    assert outcomes[0].startswith(f"{raised}: "), outcomes
    assert outcomes[0].endswith("(engine running)"), outcomes
    # the others: the sum (their allreduce met rank 0's, still pending), or rank 0's shutdown
    for o in outcomes[1:]:
        assert o == "sum" or (o.startswith("error: ") and "Rank(s) 0 called shutdown" in o), (
            outcomes)


@pytest.mark.parametrize("attempt", [1, 2])
def test_wait_interrupted_by_a_raising_signal_handler(attempt):
    _interrupt_case("raising-handler", attempt)


@pytest.mark.parametrize("attempt", [1, 2])
def test_wait_interrupted_by_keyboard_interrupt(attempt):
    _interrupt_case("keyboard-interrupt", attempt)


@pytest.mark.parametrize("attempt", [1, 2])
def test_wait_interrupted_like_pytest_timeout(attempt):
    _interrupt_case("pytest-timeout", attempt)


def test_every_rank_still_works_at_the_end():
    hvd.init()
    assert hvd.allgather(np.array([RANK])).tolist() == list(range(SIZE))
    hvd.barrier()
