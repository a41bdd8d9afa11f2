"""The torch binding on CUDA tensors, end to end (engine, fusion, DLPack, streams): one
process with and without CuPy, one NCCL rank, one rank per GPU, and ``check-build --gpu``.
Skipped where torch sees no CUDA device; what a one-GPU machine cannot run is skipped with the
reason (NCCL refuses two ranks on one GPU before 2.30)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import ROOT, mpi_env

pytestmark = pytest.mark.gpu
WORKER = Path(__file__).with_name("torch_device_worker.py")
DEVICES = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl_version() -> int:
    from hpc_horovod.common.basics import nccl_built

    return nccl_built()


NCCL = _nccl_version() if DEVICES else 0
needs_gpu = pytest.mark.skipif(DEVICES == 0, reason="needs a CUDA device")
needs_nccl = pytest.mark.skipif(NCCL == 0, reason="needs CuPy with NCCL")
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")


def _alone(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The worker as one process started without a launcher (a job of size 1)."""
    environ = mpi_env(env)
    for key in [k for k in environ if k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))
                and not k.startswith("OMPI_ALLOW")]:
        environ.pop(key)
    return subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=600)


def _passed(proc: subprocess.CompletedProcess, ranks: int) -> None:
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    for rank in range(ranks):
        assert f"rank {rank}: torch device ok" in proc.stdout, proc.stdout


@needs_gpu
def test_one_process():
    cupy = pytest.importorskip("cupy")
    assert cupy is not None
    _passed(_alone("--expect", "single"), 1)


@needs_gpu
def test_one_process_without_cupy():
    _passed(_alone("--no-cupy", "--expect", "single"), 1)


@needs_gpu
@needs_nccl
@needs_mpirun
def test_one_nccl_rank(mpirun):
    _passed(mpirun(1, WORKER, "--expect", "nccl", timeout=600), 1)


@needs_gpu
@needs_nccl
@needs_mpirun
@pytest.mark.mpi
@pytest.mark.skipif(DEVICES < 2, reason="one rank per GPU: needs two GPUs or more")
@pytest.mark.parametrize("where, env", [
    ([], {}), (["--no-set-device"], {}), ([], {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}),
], ids=["set_device", "cuda_k", "hierarchical"])
def test_one_rank_per_gpu(mpirun, where, env):
    ranks = min(DEVICES, 4)
    _passed(mpirun(ranks, WORKER, "--expect", "nccl", *where, timeout=600, env=env), ranks)


@needs_gpu
@needs_nccl
@needs_mpirun
@pytest.mark.mpi
@pytest.mark.skipif(DEVICES != 1, reason="for a machine with one GPU")
def test_two_ranks_on_one_gpu(mpirun):
    """NCCL >= 2.30 lets two ranks share the GPU with NCCL_MULTI_RANK_GPU_ENABLE=1; before,
    init sees the sharing and GPU tensors go through host memory over MPI."""
    from hpc_horovod.common.gpu_probe import nccl_version_tuple

    shares = nccl_version_tuple(NCCL) >= (2, 30, 0)
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"} if shares else {}
    proc = mpirun(2, WORKER, "--expect", "nccl" if shares else "host", timeout=600, env=env)
    _passed(proc, 2)


@needs_gpu
def test_check_build_gpu_prints_the_table():
    env = mpi_env()
    env.pop("OMPI_COMM_WORLD_RANK", None)
    proc = subprocess.run([sys.executable, "-m", "hpc_horovod.cli", "check-build", "--gpu"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    for text in ("torch", "cupy", "NCCL", "allreduce float32 Average", "PASS",
                 "all device ops passed"):
        assert text in proc.stdout, proc.stdout
    assert "FAIL" not in proc.stdout
