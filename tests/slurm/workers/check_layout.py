"""Runs on every task of a SLURM step: hpc_horovod's coordinates must be SLURM's.

Usage: check_layout.py [TASKS_PER_NODE]   e.g. "2,1" for srun -N 2 -n 3.
"""

import os
import sys

import hostlist
import numpy as np

import hpc_horovod as hvd

env = os.environ
hvd.init()
size = int(env["SLURM_STEP_NUM_TASKS"])
layout = hostlist.parse_slurm_tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
node = int(env["SLURM_NODEID"])
assert hvd.rank() == int(env["SLURM_PROCID"]), (hvd.rank(), env["SLURM_PROCID"])
assert hvd.size() == size, (hvd.size(), size)
assert hvd.local_rank() == int(env["SLURM_LOCALID"]), (hvd.local_rank(), env["SLURM_LOCALID"])
assert hvd.local_size() == layout[node], (hvd.local_size(), layout)
assert hvd.cross_rank() == node, (hvd.cross_rank(), node)
assert hvd.cross_size() == int(env["SLURM_STEP_NUM_NODES"]), hvd.cross_size()
if len(sys.argv) > 1:
    assert layout == [int(n) for n in sys.argv[1].split(",")], (layout, sys.argv[1])
total = hvd.allreduce(np.array([hvd.rank()], dtype=np.int64), op=hvd.Sum)
assert int(total[0]) == size * (size - 1) // 2, total
nodes = hvd.allgather_object(env["SLURMD_NODENAME"])
assert len(set(nodes)) == len(layout), nodes
print(f"layout ok: rank {hvd.rank()}/{hvd.size()} local {hvd.local_rank()}/{hvd.local_size()} "
      f"node {hvd.cross_rank()}/{hvd.cross_size()} on {env['SLURMD_NODENAME']}", flush=True)
hvd.shutdown()
