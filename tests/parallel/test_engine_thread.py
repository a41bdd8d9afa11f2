"""Who runs the engine's cycles while a caller waits, over real MPI processes: see
engine_thread_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi_output import assert_every_rank_says

WORKER = Path(__file__).with_name("engine_thread_worker.py")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_waiting_caller_runs_the_cycles(mpirun, ranks):
    proc = mpirun(ranks, WORKER, timeout=120)
    assert_every_rank_says(proc, ranks, "engine thread ok")
