"""Run on every rank by test_failures.py; the scenario is the first argument.

* ``exception``: the last rank raises while the others wait in an allreduce; their pending op
  fails with a HorovodInternalError naming that rank and its exception.
* ``stall``: the last rank submits 3 s late; rank 0 warns (HOROVOD_STALL_CHECK_TIME_SECONDS=1)
  naming it and the tensor, then everything completes.
* ``stall_shutdown``: the last rank never submits; with HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=2
  every rank fails with the stall message.
* ``kill``: the last rank SIGKILLs itself in the middle of allreduces; the launcher must end the
  job (the test checks its message).
* ``stall_in_set``: in the process set of ranks [1, 2], rank 2 submits late and then with
  another dtype: the stall warning and the mismatch name global ranks.
* ``early_exit``: rank 0 shuts down while the others still submit: their ops fail naming it.
* ``early_exit_pending``: rank 0 shuts down while the others wait for it in an allreduce: their
  op fails naming it, and its shutdown returns at once, while they still run.
* ``local_failure``: the backend fails on the last rank only (a read-only output buffer slipped
  past validation through the low-level ``submit``); its handle must complete with an error, and
  the others learn why at once (not after HOROVOD_PEER_TIMEOUT_SECONDS).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

import numpy as np

import hpc_horovod as hvd

scenario = sys.argv[1]
tail = hvd.ProcessSet([1, 2])
hvd.init(process_sets=[tail] if scenario == "stall_in_set" else [])
RANK, SIZE = hvd.rank(), hvd.size()
LAST = SIZE - 1


def say(text: str) -> None:
    print(f"rank {RANK}: {text}", flush=True)


if scenario == "exception":
    hvd.barrier()
    if RANK == LAST:
        time.sleep(0.2)  # let the others block in their allreduce first
        # mpirun ends the job once this rank exits: leave the others a second to print what
        # they saw (the pending op's error reaches them before this rank's exit, not after)
        atexit.register(time.sleep, 1.0)
        raise RuntimeError("boom on purpose")
    start = time.monotonic()
    try:
        hvd.allreduce(np.ones(4), name="waiting.for.peer")
    except hvd.HorovodInternalError as exc:
        say(f"failed after {time.monotonic() - start:.1f} s with: {exc}")
    else:
        raise AssertionError("the allreduce succeeded without the failed rank")
    try:  # the engine is stopped for good: new ops are refused at once
        hvd.allreduce(np.ones(1))
    except hvd.HorovodInternalError as exc:
        say(f"then refused with: {exc}")

elif scenario == "stall":
    if RANK == LAST:
        time.sleep(3.0)
    got = hvd.allreduce(np.ones(2), op=hvd.Sum, name="late.tensor")
    assert got.tolist() == [SIZE, SIZE]
    say("stall resolved")

elif scenario == "stall_shutdown":
    start = time.monotonic()
    try:
        if RANK == LAST:
            hvd.barrier()  # never matched: the others wait for "orphan"
        else:
            hvd.allreduce(np.ones(2), name="orphan")
    except hvd.HorovodInternalError as exc:
        say(f"stopped after {time.monotonic() - start:.1f} s with: {exc}")
    else:
        raise AssertionError("the stalled op completed")

elif scenario == "kill":
    for step in range(1000):
        handle = hvd.allreduce_async(np.ones(1 << 16, np.float32), op=hvd.Sum, name=f"s.{step}")
        if RANK == LAST and step == 5:
            say("killing myself")
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.synchronize(handle)
    raise AssertionError("1000 allreduces completed although a rank was killed")

elif scenario == "stall_in_set":
    if RANK in tail.ranks:
        if RANK == 2:
            time.sleep(2.5)
        got = hvd.allreduce(np.ones(1), op=hvd.Sum, process_set=tail, name="set.late")
        assert got.tolist() == [2.0]
        try:
            hvd.allreduce(np.ones(1, np.float32 if RANK == 1 else np.float64), process_set=tail,
                          name="set.bad")
        except hvd.HorovodInternalError as exc:
            say(f"failed with: {exc}")
    hvd.barrier()

elif scenario in ("early_exit", "early_exit_pending"):
    pending = scenario == "early_exit_pending"  # the others wait in their allreduce meanwhile
    if RANK == 0:
        time.sleep(0.3 if pending else 0)
        start = time.monotonic()
        hvd.shutdown()
        say(f"shut down in {time.monotonic() - start:.1f} s")
    else:
        time.sleep(0 if pending else 0.3)
        try:
            hvd.allreduce(np.ones(2), name="after.rank0.left")
        except hvd.HorovodInternalError as exc:
            say(f"failed with: {exc}")
        else:
            raise AssertionError("an allreduce completed without rank 0")
        time.sleep(5 if pending else 0)  # the script goes on without the engine

elif scenario == "local_failure":
    from hpc_horovod.common import ops, request

    buf = np.zeros(4)
    if RANK == LAST:
        buf.flags.writeable = False  # the receiving side cannot write its result
    (handle,) = ops.submit([request.broadcast_request(buf, 0, name="bad.buffer", output=buf)])
    deadline = time.monotonic() + 4
    while not hvd.poll(handle):
        if time.monotonic() > deadline:
            say("handle never completed")
            os._exit(3)
        time.sleep(0.01)
    try:
        hvd.synchronize(handle)
        hvd.allreduce(np.ones(1), name="next")  # the peer that failed never answers
    except hvd.HorovodInternalError as exc:
        say(f"failed with: {exc}")
    else:
        raise AssertionError(f"rank {RANK} saw no failure")

else:
    raise SystemExit(f"unknown scenario {scenario!r}")

hvd.shutdown()
say("done")
