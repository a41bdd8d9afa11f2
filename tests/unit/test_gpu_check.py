"""The checks of ``check-build --gpu`` (``tests/gpu/torch_device_worker.py``) run on CPU
tensors: their expected results, computed on the CPU from every rank's inputs, must match what
the engine computes on the host, alone and on two MPI ranks. This checks the checks, not a GPU:
a failure on a GPU then points at the device path. Nothing here touches CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, mpi_env

WORKER = Path(ROOT) / "tests" / "gpu" / "torch_device_worker.py"


def test_the_gpu_checks_pass_on_cpu_tensors_alone():
    env = {k: v for k, v in mpi_env().items() if not k.startswith(("OMPI_MCA", "PMIX_"))}
    proc = subprocess.run([sys.executable, str(WORKER), "--device", "cpu", "--expect", "single"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "rank 0: torch device ok" in proc.stdout


@pytest.mark.mpi
def test_the_gpu_checks_pass_on_cpu_tensors_on_two_ranks(mpirun):
    proc = mpirun(2, WORKER, "--device", "cpu", "--expect", "host", timeout=180)
    for rank in range(2):
        assert f"rank {rank}: torch device ok" in proc.stdout
