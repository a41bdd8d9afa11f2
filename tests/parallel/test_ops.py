"""Every collective over real MPI processes: results against numpy, Horovod's mismatch errors on
every rank, join, fusion, process sets, repeated steps. Each ``mpi_*.py`` module runs under
``mpirun -np N python -m pytest`` and each of its checks is one test here per N
(support.mpi_checks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi_output import assert_every_rank_says
from support import mpi_checks

HERE = Path(__file__).parent

test_ops = mpi_checks(HERE / "mpi_ops.py", ranks=(2, 3, 4))
#: a CPU node run one rank per core (one node's window shared by all of them); 32 and 64 ranks
#: run the same way by hand (``mpirun -np 32 python -m pytest tests/parallel/mpi_ops.py``), at
#: a cost the suite's time cannot take
test_ops_at_size = mpi_checks(HERE / "mpi_ops.py", ranks=(16,))
test_errors = mpi_checks(HERE / "mpi_errors.py", ranks=(2, 3, 4))
test_join = mpi_checks(HERE / "mpi_join.py", ranks=(2, 3, 4, 5),
                      env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
test_fusion = mpi_checks(HERE / "mpi_fusion.py", ranks=(2, 3))
test_process_sets = mpi_checks(HERE / "mpi_process_sets.py", ranks=(2, 3, 4),
                               env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
test_steps = mpi_checks(HERE / "mpi_steps.py", ranks=(2, 3))
# Ranks bound to one core each: host work runs on the thread that waits for it, not in the
# background (engine.overlaps).
ONE_CORE = {"HVD_TEST_ONE_CORE": "1"}
test_ops_on_one_core = mpi_checks(HERE / "mpi_ops.py", ranks=(2, 3), env=ONE_CORE)
test_steps_on_one_core = mpi_checks(HERE / "mpi_steps.py", ranks=(2, 3), env=ONE_CORE)


SCRIPT_AFTER_CHECK_BUILD = """
import numpy as np

from hpc_horovod import check_build

check_build.report()  # imports mpi4py without starting MPI, as on a login node
import hpc_horovod as hvd

hvd.init()
assert hvd.allreduce(np.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2
print(f"rank {hvd.rank()}: started MPI itself", flush=True)
"""


@pytest.mark.mpi
def test_init_starts_mpi_that_mpi4py_did_not_start(mpirun, tmp_path):
    """A whole process: mpi4py imported, MPI not started until init (pytest would start it)."""
    script = tmp_path / "after_check_build.py"
    script.write_text(SCRIPT_AFTER_CHECK_BUILD)
    proc = mpirun(2, script, timeout=60)  # and exits cleanly: MPI is finalized at exit
    assert_every_rank_says(proc, 2, "started MPI itself")
