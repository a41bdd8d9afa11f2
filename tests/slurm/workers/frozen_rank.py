"""Run by test_frozen_rank.py under plain ``srun``: rank ``argv[1]`` stops itself (SIGSTOP: its
process and its side channel stay, but nothing of it runs) between collectives, while the
others negotiate the next allreduce; their wait times out after HOROVOD_PEER_TIMEOUT_SECONDS
with an error naming the frozen rank. ``argv[2]``: ``raise`` leaves that error uncaught,
``catch`` prints it and exits with status 3. The frozen rank first writes the wall-clock time
it freezes at into ``argv[3]`` (whole: written aside, then renamed). A rank that reaches the
end prints "not stopped": that must never happen.
"""

import os
import signal
import sys
import threading
import time

import numpy as np

import hpc_horovod as hvd

frozen, how, mark = int(sys.argv[1]), sys.argv[2], sys.argv[3]
hvd.init()
for step in range(5):
    hvd.allreduce(np.ones(1024, np.float32), name=f"warm.{step}")
print(f"rank {hvd.rank()}: started", flush=True)
if hvd.rank() == frozen:
    with open(f"{mark}.tmp", "w") as f:
        f.write(repr(time.time()))
    os.rename(f"{mark}.tmp", mark)
    # to this thread: a process-directed SIGSTOP may take a moment to reach one, and this one
    # could go on into the negotiation meanwhile
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
try:
    hvd.allreduce(np.ones(1024, np.float32), name="after.freeze")
except hvd.HorovodInternalError as error:
    if how == "raise":
        raise
    print(f"rank {hvd.rank()}: caught: {error}", flush=True)
    sys.exit(3)
print(f"rank {hvd.rank()}: not stopped", flush=True)
