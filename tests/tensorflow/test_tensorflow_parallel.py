"""hpc_horovod.tensorflow over real MPI processes, on 2 ranks (the checks' expected values are
those of 2 ranks, and each process imports TensorFlow, seconds on a small machine), and 3 for the
checks of the ranks' order in tf.compat.v1 graphs. Each
``mpi_*.py`` module runs under ``mpirun -np 2 python -m pytest`` and each of its checks is one
test here (support.mpi_checks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import mpi_checks

pytest.importorskip("tensorflow")
HERE = Path(__file__).parent
# One intra- and one inter-op thread per rank keep two ranks on two cores; a rank that stops
# submitting makes the others fail within a minute instead of at the timeout.
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}

test_ops = mpi_checks(HERE / "mpi_ops.py", ranks=(2,),
                      env={**TF_ENV, "HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
test_training = mpi_checks(HERE / "mpi_training.py", ranks=(2,), env=TF_ENV)
test_tf1 = mpi_checks(HERE / "mpi_tf1.py", ranks=(2,), env=TF_ENV)
test_parity = mpi_checks(HERE / "mpi_parity.py", ranks=(2,), env=TF_ENV)
test_tf1_order = mpi_checks(HERE / "mpi_tf1_order.py", ranks=(2,), env=TF_ENV)
