"""Run on 2 ranks by test_job_end.py (under ``hpc-horovod run``) and by
tests/slurm/test_job_end_srun.py (under ``srun --kill-on-bad-exit=1``): rank 1 fails in the way
the first argument names, and the whole job must end soon, non-zero, naming rank 1.

* ``kill``: rank 1 SIGKILLs itself between allreduces.
* ``stall``: rank 1 stops submitting (sleeps 120 s, as a stuck data loader would); run with
  HOROVOD_STALL_CHECK_TIME_SECONDS=2 and HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=8.
* ``exception``: rank 1 raises, uncaught, while rank 0 waits in an allreduce.
* ``mismatch``: both submit one name with different shapes; nobody catches the error.
* ``exit``: rank 1 returns from the script without ``shutdown`` while rank 0 still reduces.
* ``join_allgather`` / ``join_broadcast``: rank 0 joins, rank 1 calls allgather / broadcast
  and leaves the error uncaught.

Rank 1 writes the wall-clock time at which it fails into the file named by $JOB_END_MARK, so
that the tests can measure how long the job takes to end after the failure. A rank that reaches
the end prints ``rank R: not stopped``: that must never happen.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import hpc_horovod as hvd

scenario = sys.argv[1]
hvd.init()
RANK = hvd.rank()
print(f"rank {RANK}: started", flush=True)
hvd.barrier()


def failing() -> None:
    """Rank 1 notes the wall-clock time it fails at, in the file $JOB_END_MARK (a launcher may
    drop the last output of a task it kills)."""
    if RANK == 1:
        with open(os.environ["JOB_END_MARK"], "w") as mark:
            mark.write(f"{time.time():.3f}")


def warm_up(steps: int = 20) -> None:
    """The same number of allreduces on every rank."""
    for step in range(steps):
        hvd.allreduce(np.ones(1024, np.float32), name=f"warm.{step}")


def reduce_for(seconds: float, tag: str) -> None:
    """Allreduces until the job ends (the peer has failed by then)."""
    end = time.monotonic() + seconds
    step = 0
    while time.monotonic() < end:
        hvd.allreduce(np.ones(1024, np.float32), name=f"{tag}.{step}")
        step += 1


if scenario in ("kill", "stall", "exit"):
    warm_up()
    if RANK == 1:
        failing()
        if scenario == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif scenario == "stall":
            time.sleep(120)
        else:
            sys.exit(0)
    reduce_for(300, "after")
elif scenario == "exception":
    if RANK == 1:
        time.sleep(0.3)  # rank 0 waits in its allreduce by then
        failing()
        raise ValueError("rank 1 fails on purpose")
    hvd.allreduce(np.ones(4), name="waits.for.rank1")
elif scenario == "mismatch":
    failing()
    hvd.allreduce(np.ones(3 + RANK), name="shapes.differ")
elif scenario in ("join_allgather", "join_broadcast"):
    failing()
    if RANK == 0:
        hvd.join()
    elif scenario == "join_allgather":
        hvd.allgather(np.ones((2, 2)), name="gather.while.joined")
    else:
        hvd.broadcast(np.ones(2), root_rank=1, name="bcast.while.joined")
    time.sleep(300)  # rank 0, if join ever returned
else:
    raise SystemExit(f"unknown scenario {scenario}")
print(f"rank {RANK}: not stopped", flush=True)
