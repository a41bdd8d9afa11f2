"""The shared-memory allreduce over real MPI processes on one node (2, 3 and 4 ranks, the last
two oversubscribing the machine): results against MPI's own Allreduce, the staging slots under
skewed ranks, and the window's life inside hpc_horovod, process sets included (see
node_allreduce_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi_output import assert_every_rank_says

WORKER = Path(__file__).with_name("node_allreduce_worker.py")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_node_allreduce_matches_mpi(mpirun, ranks):
    proc = mpirun(ranks, WORKER, timeout=240, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert_every_rank_says(proc, ranks, "node allreduce ok")


def test_shm_disable_keeps_every_allreduce_in_mpi(mpirun):
    proc = mpirun(2, WORKER, timeout=240,
                  env={"HOROVOD_SHM_DISABLE": "1", "HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert_every_rank_says(proc, 2, "node allreduce ok")
