"""A sweep from a notebook: ``submit_array`` runs an ensemble of data-parallel members (a job
array), then a second session finds the jobs again by id, reads their results and cleans them
up. The member function lives in ``__main__``, as in a notebook.

Usage: array_submit.py submit WORKDIR | array_submit.py attach WORKDIR JOB_ID...
"""

import json
import sys

import hpc_horovod.slurm
from hpc_horovod.slurm import Job


def member(seed, scale):
    import numpy as np

    import hpc_horovod as hvd

    hvd.init()
    total = hvd.allreduce(np.array([float(seed * (hvd.rank() + 1))]), op=hvd.Sum)
    return [seed, hvd.rank(), hvd.size(), float(total[0]) * scale]


mode, workdir = sys.argv[1], sys.argv[2]
if mode == "submit":
    jobs = hpc_horovod.slurm.submit_array(member, [(1,), (2,), (3,)], kwargs={"scale": 10},
                                          parallel=1, ntasks_per_node=2, partition="debug",
                                          time="5", job_name="sweep", modules=[],
                                          workdir=workdir)
    print("SUBMITTED", json.dumps([job.job_id for job in jobs]), flush=True)
    try:
        jobs[2].cleanup()
    except RuntimeError as exc:
        print("REFUSED", exc, flush=True)
    print("FIRST", json.dumps(jobs[0].result(progress=False)), flush=True)
else:
    found = hpc_horovod.slurm.jobs(workdir)
    print("LISTED", json.dumps([[job.job_id, str(job.folder)] for job in found]), flush=True)
    results = []
    for job_id in sys.argv[3:]:
        job = Job.attach(job_id, workdir)
        results.append(job.result(progress=False))
        job.cleanup()
    print("RESULTS", json.dumps(results), flush=True)
