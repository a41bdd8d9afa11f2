"""A training loop that stops on SIGUSR2, checkpoints, gets requeued and resumes.

Usage: train_requeue.py CHECKPOINT PROGRESS. Rank 0 writes the step it reached to PROGRESS so
that the test knows when to send the signal. The first run loops until signalled; the resumed
run (SLURM_RESTART_COUNT=1) checks that it starts at the saved step and finishes after 5 more.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np

import hpc_horovod as hvd
from hpc_horovod import slurm

checkpoint, progress = Path(sys.argv[1]), Path(sys.argv[2])
hvd.init()
restarts = slurm.restart_count()
state = {"step": 0, "weights": 0.0}
if checkpoint.exists():
    state = json.loads(checkpoint.read_text())
state = hvd.broadcast_object(state, root_rank=0)
start = state["step"]
print(f"rank {hvd.rank()}: restart {restarts}, starting at step {start}", flush=True)


def save():
    checkpoint.write_text(json.dumps(state))
    print(f"rank {hvd.rank()}: saved checkpoint at step {state['step']}", flush=True)


stopper = slurm.requeue_on_signal(save)
step = start
while True:
    if stopper.should_stop():
        print(f"rank {hvd.rank()}: stopped at step {step}", flush=True)
        break
    grad = hvd.allreduce(np.ones(4) * (hvd.rank() + 1), op=hvd.Sum, name="grad")
    state = {"step": step + 1, "weights": state["weights"] + float(grad[0])}
    step += 1
    if hvd.rank() == 0:
        progress.write_text(str(step))
    if restarts >= 1 and step >= start + 5:
        assert start > 0, "the resumed run did not start from the checkpoint"
        print(f"rank {hvd.rank()}: resumed from step {start}, finished at step {step} "
              f"(SLURM_RESTART_COUNT={restarts})", flush=True)
        break
    time.sleep(0.05)
hvd.shutdown()
