"""The long run (long_run.py) at the size of a test: 8 ranks on this machine's cores, 300
DistributedOptimizer steps in small buckets, an allgather, a broadcast and an allreduce on a
process set of half the ranks every 50 steps, then uneven ends and a join. No rank hangs, and
every rank holds the same parameters after every step."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
LONG_RUN = Path(__file__).parent / "long_run.py"
RANKS, STEPS = 8, 300


@pytest.mark.mpi
def test_long_run_on_8_ranks(mpirun):
    proc = mpirun(RANKS, LONG_RUN, STEPS, timeout=300, env={"HOROVOD_BUCKET_BYTES": "2048"})
    out = proc.stdout + proc.stderr
    for rank in range(RANKS):
        assert f"rank {rank}: long run ok ({STEPS + 3 * rank} steps)" in out, out
