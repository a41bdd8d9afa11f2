"""Hierarchical allreduce (HOROVOD_HIERARCHICAL_ALLREDUCE) over real MPI processes: node step,
cross-node step, padding of sizes that do not split evenly, float16 through float32."""

from __future__ import annotations

from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("hierarchical_worker.py")


@pytest.mark.mpi
def test_hierarchical_allreduce_matches_a_flat_one(mpirun):
    proc = mpirun(4, WORKER, timeout=120)
    for rank in range(4):
        assert f"rank {rank}: hierarchical ok" in proc.stdout
