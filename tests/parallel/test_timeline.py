"""HOROVOD_TIMELINE over real MPI processes: the checks of mpi_timeline.py, each a test per N
(support.mpi_checks)."""

from __future__ import annotations

from pathlib import Path

from support import mpi_checks

test_timeline = mpi_checks(Path(__file__).with_name("mpi_timeline.py"), ranks=(2,))
