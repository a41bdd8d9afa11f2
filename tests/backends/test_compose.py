"""The choice of backends at ``init`` (``hpc_horovod.backends.compose``) where MPI is missing or
does not fit the launch: a job of size 1 runs without mpi4py (never imported), and a launcher or
MPI library that disagrees with the job is named before MPI starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import clean_env

ROOT = Path(__file__).resolve().parents[2]


# -- without MPI ----------------------------------------------------------------------------------
SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import hpc_horovod as hvd

    hvd.init()
    assert (hvd.size(), hvd.rank(), hvd.local_rank()) == (1, 0, 0)
    assert not hvd.mpi_enabled()
    assert hvd.allreduce(np.ones(3), op=hvd.Sum).tolist() == [1.0, 1.0, 1.0]
    assert hvd.allgather(np.ones((2, 2))).shape == (2, 2)
    assert hvd.broadcast_object({"k": 1}) == {"k": 1}
    hvd.barrier()
    hvd.shutdown()
    hvd.init()
    assert hvd.reducescatter(np.arange(4.0), op=hvd.Sum).tolist() == [0.0, 1.0, 2.0, 3.0]
    hvd.shutdown()
    assert hvd.mpi_built() is False  # mpi4py cannot be imported in this interpreter
    print("ATTEMPTS", sys.mpi4py_attempts)
""")

SITECUSTOMIZE = textwrap.dedent("""
    import sys

    sys.mpi4py_attempts = []


    class HideMpi4py:
        # Refuse mpi4py, and record who asked for it.
        def find_spec(self, name, path=None, target=None):
            if name == "mpi4py" or name.startswith("mpi4py."):
                sys.mpi4py_attempts.append(name)
                raise ImportError("mpi4py is hidden in this test")
            return None


    sys.meta_path.insert(0, HideMpi4py())
""")


def test_size_one_script_runs_without_mpi4py(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = clean_env({"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # only mpi_built() asked for mpi4py; init and the collectives never did
    assert "ATTEMPTS ['mpi4py']" in proc.stdout, proc.stdout + proc.stderr
    assert "mpi4py" not in proc.stderr


@pytest.mark.parametrize("launch", [
    # a plugin the MPI library does not speak: every task starts as an MPI singleton
    {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
     "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1",
     "SLURM_STEP_NODELIST": "node1", "SLURM_STEP_TASKS_PER_NODE": "2",
     "SLURM_MPI_TYPE": "pmi2"},
    {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"},
], ids=["srun-without-pmix", "explicit"])
def test_launcher_and_mpi_disagreeing_on_the_size_is_named(tmp_path, launch):
    code = "import hpc_horovod as hvd\nhvd.init()\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=clean_env({"PYTHONPATH": str(ROOT), **launch}), timeout=120,
                          cwd=tmp_path)
    assert proc.returncode != 0
    assert "MpiWiringError: MPI did not wire up the 2 tasks of this" in proc.stderr, proc.stderr
    assert "MPI sees a world of 1 process(es)" in proc.stderr
    assert "srun --mpi=pmix python" in proc.stderr


def test_srun_without_mpi_plugin_is_named_before_mpi_starts(tmp_path):
    """`srun --mpi=none`: no plugin variable at all; the error comes before MPI is loaded."""
    launch = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
              "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2",
              "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "node1",
              "SLURM_STEP_TASKS_PER_NODE": "2"}
    code = "import sys, hpc_horovod as hvd\ntry:\n    hvd.init()\nfinally:\n" \
           "    print('MPI loaded:', 'mpi4py.MPI' in sys.modules)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=clean_env({"PYTHONPATH": str(ROOT), **launch}), timeout=120,
                          cwd=tmp_path)
    assert proc.returncode != 0
    assert "MpiWiringError: MPI did not wire up the 2 tasks of this slurm launch: srun " \
           "started these 2 tasks without an MPI plugin" in proc.stderr, proc.stderr
    assert "srun --mpi=pmix" in proc.stderr
    assert "MPI loaded: False" in proc.stdout


def test_mpi_launch_without_mpi4py_names_the_install(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    script = tmp_path / "train.py"
    script.write_text("import hpc_horovod as hvd\nhvd.init()\n")
    env = clean_env({"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
                     "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert "TopologyError" in proc.stderr
    assert "rank 0 of 2 started by openmpi, but mpi4py is not installed" in proc.stderr
    assert "pip install hpc-horovod[mpi]" in proc.stderr
