"""Trains until rank KILLED (argv[1]) SIGKILLs itself at step 3; the others keep reducing.

Under `srun --kill-on-bad-exit=1` SLURM must end the whole step soon after; without it, the
survivors would only stop at the peer timeout. Prints "survived" if a rank ever finishes.
"""

import os
import signal
import sys
import time

import numpy as np

import hpc_horovod as hvd

hvd.init()
killed = int(sys.argv[1])
for step in range(6000):
    if step == 3 and hvd.rank() == killed:
        print(f"rank {hvd.rank()}: SIGKILL at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        hvd.allreduce(np.ones(1000, dtype=np.float32), name="grad")
    except hvd.HorovodInternalError as exc:
        print(f"rank {hvd.rank()}: allreduce failed at step {step}: {exc}", flush=True)
        sys.exit(1)
    time.sleep(0.01)
print(f"rank {hvd.rank()}: survived", flush=True)
