"""Rank 0 stops for ``argv[1]`` seconds inside step 3 (a long checkpoint, say) while the other
ranks already wait in that step's allreduce; then every rank goes on to the end and prints
"done". A rank alive but slow must not be taken for a lost one.
"""

import sys
import time

import numpy as np

import hpc_horovod as hvd

hvd.init()
pause = float(sys.argv[1])
for step in range(8):
    if step == 3 and hvd.rank() == 0:
        print(f"rank 0: checkpoint for {pause:.0f} s", flush=True)
        time.sleep(pause)
    total = hvd.allreduce(np.full(1000, step, dtype=np.float32), op=hvd.Sum, name="grad")
    assert (total == step * hvd.size()).all(), (step, total[:3])
print(f"rank {hvd.rank()}: done", flush=True)
hvd.shutdown()
