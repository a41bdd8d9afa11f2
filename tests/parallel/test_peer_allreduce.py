"""Sums through the other ranks' memory over real MPI processes on one node (2, 3 and 4 ranks,
the last two oversubscribing the machine): see peer_allreduce_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi_output import assert_every_rank_says

WORKER = Path(__file__).with_name("peer_allreduce_worker.py")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_peer_allreduce(mpirun, ranks):
    proc = mpirun(ranks, WORKER, timeout=240, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert_every_rank_says(proc, ranks, "peer allreduce ok")
