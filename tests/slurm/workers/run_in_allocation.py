"""The batch script of a 2-task job calls ``hpc_horovod.run(fn, np=2)``: inside the allocation
the ranks start with srun, on both nodes."""

import json
import os

import hpc_horovod


def where(tag):
    import os

    import hpc_horovod as hvd

    hvd.init()
    return [tag, hvd.rank(), hvd.size(), os.environ["SLURMD_NODENAME"],
            "SLURM_STEP_ID" in os.environ]


print("RUN " + json.dumps(hpc_horovod.run(where, args=("x",), np=2, verbose=True)), flush=True)
print("BATCH", os.environ.get("SLURM_STEP_ID", "none"), flush=True)
