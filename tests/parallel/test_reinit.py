"""``init`` after ``shutdown`` or after a fatal error gives a fresh, working engine on every rank
(numpy and torch APIs): the checks of mpi_reinit.py; and a wait cut short by an interrupt leaves
nothing broken (mpi_interrupt.py). Each a test per N (support.mpi_checks)."""

from __future__ import annotations

from pathlib import Path

from support import mpi_checks

HERE = Path(__file__).parent

test_reinit = mpi_checks(HERE / "mpi_reinit.py", ranks=(2, 3),
                         env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})

test_interrupt = mpi_checks(HERE / "mpi_interrupt.py")
