"""``init`` after ``shutdown`` or after a fatal error gives a fresh, working engine on every rank
(numpy and torch APIs): reinit_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi_output import by_rank

pytestmark = pytest.mark.mpi


def test_init_after_a_fatal_error_or_shutdown_gives_a_working_engine(mpirun):
    proc = mpirun(2, Path(__file__).parent / "reinit_worker.py", timeout=150)
    out = by_rank(proc)
    for rank in range(2):
        assert f"rank {rank}: reinit ok" in out[rank], proc.stdout + proc.stderr
