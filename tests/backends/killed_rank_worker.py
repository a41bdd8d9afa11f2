"""Rank 1 is killed (SIGKILL) while the others wait for it in the node's shared window; the job
must end with rank 1 named, and leave no segment behind."""

import os
import signal
import sys

import numpy as np

import hpc_horovod as hvd

hvd.init()
x = np.ones(1 << 20, np.float32)
for step in range(3):
    hvd.allreduce_(x, name=f"before.{step}")
print(f"rank {hvd.rank()} pid {os.getpid()} ready", flush=True)
if hvd.rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
hvd.allreduce_(x, name="after")
print(f"rank {hvd.rank()} finished an allreduce without rank 1", flush=True)
sys.exit(3)
