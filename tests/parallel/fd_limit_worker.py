"""Run by test_fd_limit.py under ``mpirun``: rank 0 first lowers its limit of open files
(``argv[2]``: ``soft``, the soft limit; ``both``, soft and hard) to the files it has open once
Open MPI started, plus 3: too few for its connections to the other ranks. Then every rank
starts (``hvd.init``), prints its soft limit, and rank ``argv[1]`` kills itself (SIGKILL)
between allreduces: the survivors' next op must raise, naming it. A survivor prints
"rank R: stopped: <error>"; one that reaches the end prints "survived"."""

import os
import resource
import signal
import sys

import numpy as np
from mpi4py import MPI

import hpc_horovod as hvd

doomed, lowered = int(sys.argv[1]), sys.argv[2]
if MPI.COMM_WORLD.Get_rank() == 0:
    low = len(os.listdir("/proc/self/fd")) + 3
    hard = low if lowered == "both" else resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    print(f"rank 0: ulimit -n lowered to {low}", flush=True)
hvd.init()
soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
print(f"rank {hvd.rank()}: started, ulimit -n {soft}", flush=True)
try:
    for step in range(200):
        if step == 3 and hvd.rank() == doomed:
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.allreduce(np.ones(16, np.float32), name="grad")
except hvd.HorovodInternalError as error:
    print(f"rank {hvd.rank()}: stopped: {error}", flush=True)
    raise SystemExit(1) from None
print(f"rank {hvd.rank()}: survived", flush=True)
