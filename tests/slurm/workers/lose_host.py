"""Trains (allreduces, step after step) until every rank on host ``argv[1]`` SIGKILLs itself at
step 5, as when a host is lost; each of them first writes the time of its death into
``<argv[2]>.<rank>`` (whole: written aside, then renamed). The survivors go on: what ends them
is what the test looks at. A survivor whose allreduce fails prints when; one that reaches the
end prints "survived".

With ``argv[3] == "fork"`` every rank first forks a child, as a data loader's worker, which
notices its parent's death by polling as torch's does: on the doomed host it outlives its rank
by up to 15 s, longer than the survivors may take to stop, so it must not keep the dead rank's
connections open (the job itself ends only with it).
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
if sys.argv[3:] == ["fork"]:
    parent = os.getpid()
    if os.fork() == 0:
        while os.getppid() == parent:
            time.sleep(15.0 if socket.gethostname() == doomed else 0.1)
        os._exit(0)
try:
    for step in range(600):
        if step == 5 and socket.gethostname() == doomed:
            with open(f"{mark}.tmp{hvd.rank()}", "w") as f:
                f.write(repr(time.time()))
            os.rename(f"{mark}.tmp{hvd.rank()}", f"{mark}.{hvd.rank()}")
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.allreduce(np.ones(1000, dtype=np.float32), name="grad")
        time.sleep(0.05)
except hvd.HorovodInternalError:
    print(f"rank {hvd.rank()}: stopped at {time.time()!r}", flush=True)
    raise
print(f"rank {hvd.rank()}: survived", flush=True)
