"""Run on every rank by test_log_ranks.py: three training steps of two gradients reduced as one
group (``grad.0``, ``grad.1``) and one broadcast (``weights``), so that the ranks agree on three
names once and reuse their plans afterwards; each rank then prints that it is done. With the
argument ``late``, the last rank starts 2 s late: rank 0 warns of the stall
(``HOROVOD_STALL_CHECK_TIME_SECONDS=1``)."""

from __future__ import annotations

import sys
import time

import numpy as np

import hpc_horovod as hvd

hvd.init()
if sys.argv[1:] == ["late"] and hvd.rank() == hvd.size() - 1:
    time.sleep(2)
for _ in range(3):
    a, b = hvd.grouped_allreduce([np.ones(4, np.float32), np.ones(2, np.float32)],
                                 name="grad", op=hvd.Sum)
    assert a.tolist() == [hvd.size()] * 4 and b.tolist() == [hvd.size()] * 2
    hvd.broadcast(np.arange(3.0), root_rank=0, name="weights")
print(f"rank {hvd.rank()}: done", flush=True)
hvd.shutdown()
