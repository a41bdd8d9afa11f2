"""The hierarchical host backend over real MPI processes: every check of
``mpi_hierarchical.py`` runs under ``mpirun -np N`` for N = 2, 3, 4 (the layouts also at 5) and
is one test here per N (support.mpi_checks)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from support import mpi_checks, run_mpi

HERE = Path(__file__).parent
CHECKS = HERE / "mpi_hierarchical.py"

test_hierarchical = mpi_checks(CHECKS, ranks=(2, 3, 4))
#: 3 + 2, 2 + 3 and 2 + 2 + 1 ranks per node
test_layouts_at_five_ranks = mpi_checks(CHECKS, ranks=(5,),
                                        only=["test_layouts_bit_identical_to_flat"])


@pytest.mark.mpi
def test_killed_rank_ends_the_job_named_and_leaves_no_segment():
    directory = "/dev/shm"
    before = set(os.listdir(directory))
    proc = run_mpi(3, HERE / "killed_rank_worker.py", timeout=300, check=False,
                   env={"HOROVOD_PEER_TIMEOUT_SECONDS": "20"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished an allreduce without rank 1" not in out, out
    assert re.search(r"rank 1 with PID \d+ .*(signal 9|Killed)", out, re.S), out
    left = [n for n in set(os.listdir(directory)) - before if n.startswith("osc_sm")]
    assert left == [], left
