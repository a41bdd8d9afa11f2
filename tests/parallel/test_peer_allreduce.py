"""Sums through the other ranks' memory over real MPI processes on one node (2, 3 and 4 ranks,
the last two oversubscribing the machine): see peer_allreduce_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("peer_allreduce_worker.py")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_peer_allreduce(mpirun, ranks):
    proc = mpirun(ranks, WORKER, timeout=240, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    for rank in range(ranks):
        assert f"rank {rank}: peer allreduce ok" in proc.stdout, proc.stdout + proc.stderr
