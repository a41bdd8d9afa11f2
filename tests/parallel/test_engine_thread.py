"""Who runs the engine's cycles while a caller waits, over real MPI processes: the checks of
mpi_engine_thread.py, each a test per N (support.mpi_checks)."""

from __future__ import annotations

from pathlib import Path

from support import mpi_checks

test_engine_thread = mpi_checks(Path(__file__).with_name("mpi_engine_thread.py"), ranks=(2, 3, 4))
test_engine_thread_on_one_core = mpi_checks(Path(__file__).with_name("mpi_engine_thread.py"),
                                            ranks=(2, 3), env={"HVD_TEST_ONE_CORE": "1"})
