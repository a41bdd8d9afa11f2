"""What a notebook cell on a login node does: define a function, submit it to SLURM, wait for
the per-rank results. The function lives in ``__main__``, as in a notebook, so it travels by
value (cloudpickle).

Usage: notebook_submit.py ok|raise|sleep|steps WORKDIR

``steps``: rank 0 prints eight steps while the job runs, all of which ``result()`` shows.
"""

import json
import sys

import hpc_horovod.slurm


def train(scale, mode):
    import os
    import time

    import numpy as np

    import hpc_horovod as hvd

    hvd.init()
    print(f"rank {hvd.rank()} of {hvd.size()} starts on {os.environ['SLURMD_NODENAME']}",
          flush=True)
    if mode == "raise" and hvd.rank() == 1:
        raise ValueError(f"rank {hvd.rank()} refuses")
    if mode == "sleep":
        for step in range(600):
            print(f"step {step}", flush=True)
            time.sleep(0.5)
    if mode == "steps":
        for step in range(8):
            print(f"step {step}", flush=True)
            time.sleep(0.4)
    total = hvd.allreduce(np.array([float(hvd.rank() + 1)]), op=hvd.Sum)
    return {"rank": hvd.rank(), "total": float(total[0]) * scale,
            "node": os.environ["SLURMD_NODENAME"]}


mode, workdir = sys.argv[1], sys.argv[2]
job = hpc_horovod.slurm.submit(train, args=(10.0,), kwargs={"mode": mode}, nodes=2,
                               ntasks_per_node=1, partition="debug", time="5",
                               job_name=f"nb-{mode}", modules=[], workdir=workdir)
print(f"SUBMITTED {job.job_id} {job.size}", flush=True)
try:
    results = job.result(poll=0.3, stream=sys.stdout, lines=50 if mode == "steps" else 3)
except ValueError as exc:
    print("RAISED", json.dumps([str(exc), getattr(exc, "__notes__", [])]), flush=True)
    sys.exit(3)
print("RESULT", json.dumps(results), flush=True)
