"""Trains (allreduces, step after step) until every rank on host ``argv[1]`` SIGKILLs itself at
step 5, as when a host is lost; each of them first writes the time of its death into
``<argv[2]>.<rank>`` (whole: written aside, then renamed). The survivors go on: what ends them
is what the test looks at. A rank that reaches the end prints "survived".
"""

import os
import signal
import socket
import sys
import time

import numpy as np

import hpc_horovod as hvd

hvd.init()
doomed, mark = sys.argv[1], sys.argv[2]
print(f"rank {hvd.rank()} on {socket.gethostname()}", flush=True)
for step in range(600):
    if step == 5 and socket.gethostname() == doomed:
        with open(f"{mark}.tmp{hvd.rank()}", "w") as f:
            f.write(repr(time.time()))
        os.rename(f"{mark}.tmp{hvd.rank()}", f"{mark}.{hvd.rank()}")
        os.kill(os.getpid(), signal.SIGKILL)
    hvd.allreduce(np.ones(1000, dtype=np.float32), name="grad")
    time.sleep(0.05)
print(f"rank {hvd.rank()}: survived", flush=True)
