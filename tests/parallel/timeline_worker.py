"""Run on every rank by test_timeline.py with HOROVOD_TIMELINE=<argv[1]>: a few named ops, then a
re-init with HOROVOD_TIMELINE=DYNAMIC where only the ops between ``start_timeline(argv[2])`` and
``stop_timeline()`` are recorded. The test reads both files."""

from __future__ import annotations

import os
import sys

import numpy as np

import hpc_horovod as hvd

static_path, dynamic_path = sys.argv[1], sys.argv[2]
assert os.environ["HOROVOD_TIMELINE"] == static_path

hvd.init()
RANK = hvd.rank()
for _ in range(3):
    hvd.allreduce(np.ones(16, np.float32), name="grad.w")
    hvd.allreduce(np.ones(4, np.float32), name="grad.b")
hvd.allgather(np.ones((RANK + 1, 2)), name="gathered")
hvd.broadcast(np.ones(3), root_rank=0, name="weights")
hvd.alltoall(np.ones(hvd.size()), name="exchanged")
hvd.reducescatter(np.ones(hvd.size()), name="scattered")
hvd.allreduce(np.ones(4), op=hvd.Adasum, name="adasum")
hvd.shutdown()

os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"
hvd.init()
hvd.allreduce(np.ones(8), name="before.start")
hvd.start_timeline(dynamic_path)
hvd.allreduce(np.ones(8), name="while.recording")
hvd.allgather(np.ones(2), name="gather.while.recording")
hvd.stop_timeline()
hvd.allreduce(np.ones(8), name="after.stop")
hvd.start_timeline(dynamic_path + ".second")
hvd.allreduce(np.ones(8), name="second.recording")
hvd.shutdown()  # closes the open timeline
print(f"rank {RANK}: timeline ok", flush=True)
