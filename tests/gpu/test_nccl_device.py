"""The NCCL backend on real GPUs: one rank always, one rank per GPU when there are several (NCCL
refuses two ranks on one device). Skipped where CuPy, NCCL or a CUDA device is missing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, mpi_env

pytestmark = pytest.mark.gpu
WORKER = Path(__file__).with_name("nccl_device_worker.py")


def _cuda_devices() -> int:
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001 - cupy raises various errors without CUDA
        return 0
    if not nccl.available:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


DEVICES = _cuda_devices()
needs_gpu = pytest.mark.skipif(DEVICES == 0, reason="needs CuPy with NCCL and a CUDA device")


def _check(proc: subprocess.CompletedProcess, ranks: int) -> None:
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    for rank in range(ranks):
        assert f"rank {rank}: nccl ok" in proc.stdout


@needs_gpu
def test_nccl_backend_on_one_gpu():
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True,
                          env=mpi_env(), cwd=ROOT, timeout=300)
    _check(proc, 1)


@needs_gpu
@pytest.mark.mpi
@pytest.mark.skipif(DEVICES < 2, reason="one rank per GPU: needs two GPUs or more")
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_nccl_backend_one_rank_per_gpu(mpirun):
    ranks = min(DEVICES, 4)
    _check(mpirun(ranks, WORKER, timeout=300), ranks)
