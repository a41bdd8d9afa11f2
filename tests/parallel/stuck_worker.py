"""Run by test_stuck.py under ``hpc-horovod run -np N``: one rank (the second argument; the
last one by default) freezes itself (SIGSTOP: its process and its side channel stay, but
nothing of it runs) and the others must not wait for ever. The first argument says where it
freezes:

* ``allreduce`` / ``broadcast`` / ``allgather``: inside the backend's data call of the op named
  ``frozen.op`` (the backend method is wrapped on that rank only), while the others are inside
  the blocking MPI call. The job must end non-zero, its output naming the frozen rank and the
  op, rank 0's summary included (or, when rank 0 is the frozen one, the others' messages,
  which say that rank 0 did not answer).
* ``negotiation``: between ops, while the others negotiate ``after.freeze``; their wait times
  out, and the error raised to the caller names the frozen rank.

Every rank writes its pid into ``$STUCK_DIR/pid.<rank>``; the frozen rank writes the wall-clock
time it freezes at into ``$STUCK_DIR/frozen_at``. A rank that reaches the end prints
``rank R: not stopped``: that must never happen.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

import hpc_horovod as hvd
from hpc_horovod.common import basics
from hpc_horovod.common.errors import HorovodInternalError

scenario = sys.argv[1]
out = Path(os.environ["STUCK_DIR"])
hvd.init()
RANK = hvd.rank()
FROZEN = int(sys.argv[2]) if len(sys.argv) > 2 else hvd.size() - 1
(out / f"pid.{RANK}").write_text(str(os.getpid()))
for step in range(5):
    hvd.allreduce(np.ones(1024, np.float32), name=f"warm.{step}")
print(f"rank {RANK}: started", flush=True)


def freeze() -> None:
    (out / "frozen_at").write_text(f"{time.time():.3f}")
    # To this thread, not the process: a process-directed SIGSTOP goes to whichever thread the
    # kernel picks (the main one, asleep in a wait), and until that thread has run the calling
    # one may return and go on into the data call, whose peers then complete.
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


if scenario == "negotiation":
    if RANK == FROZEN:
        freeze()
    try:
        hvd.allreduce(np.ones(1024, np.float32), name="after.freeze")
    except HorovodInternalError as error:
        print(f"rank {RANK}: caught: {error}", flush=True)
        raise SystemExit(3) from None
else:
    if RANK == FROZEN:
        backend = basics.engine().process_set_backend(0)
        method = {"allreduce": "allreduce", "broadcast": "bcast",
                  "allgather": "allgatherv"}[scenario]
        original = getattr(backend, method)

        def frozen(*args, **kwargs):
            freeze()
            return original(*args, **kwargs)

        setattr(backend, method, frozen)
    data = np.ones(1024, np.float32)
    if scenario == "allreduce":
        hvd.allreduce(data, name="frozen.op")
    elif scenario == "broadcast":
        hvd.broadcast(data, root_rank=FROZEN, name="frozen.op")  # nobody completes it
    else:
        hvd.allgather(data, name="frozen.op")
print(f"rank {RANK}: not stopped", flush=True)
