"""hpc_horovod.torch over real MPI processes. Each ``mpi_*.py`` module runs under
``mpirun -np N python -m pytest`` and each of its checks is one test here per N
(support.mpi_checks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import mpi_checks

pytest.importorskip("torch")
HERE = Path(__file__).parent

test_ops = mpi_checks(HERE / "mpi_ops.py", ranks=(2, 3, 4))
test_optimizer = mpi_checks(HERE / "mpi_optimizer.py", ranks=(2, 3))
test_horovod_suite = mpi_checks(HERE / "mpi_horovod_suite.py", ranks=(2, 3))
