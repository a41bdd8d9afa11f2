"""device_paths_worker.py under mpirun: inputs kept for the engine's stream (one NCCL rank), and
on 4 ranks in two fake nodes (node = rank // 2): the flat NCCL allreduce by default, the
hierarchical one when asked for, and Horovod's GPU Adasum. Four ranks need 4 GPUs, or 2 GPUs
shared by 2 ranks each with NCCL >= 2.30 (NCCL documents hangs beyond 2 ranks per GPU)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from support import run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
WORKER = Path(__file__).with_name("device_paths_worker.py")
DEVICES = torch.cuda.device_count() if torch.cuda.is_available() else 0
#: Open MPI's UCX one-sided component may abort on machines without a UCX network
BASE_ENV = {"OMPI_MCA_osc": "^ucx"}


def _nccl_version() -> int:
    from hpc_horovod.common.basics import nccl_built

    return nccl_built() if DEVICES else 0


NCCL = _nccl_version()


def ranks_env(ranks: int) -> dict | None:
    """The environment for ``ranks`` NCCL ranks here (at most 2 per GPU, sharing only with
    NCCL >= 2.30), None when this machine cannot run them."""
    from hpc_horovod.common.gpu_layout import MAX_RANKS_PER_GPU
    from hpc_horovod.common.gpu_probe import nccl_version_tuple

    if DEVICES >= ranks:
        return dict(BASE_ENV)
    if NCCL and nccl_version_tuple(NCCL) >= (2, 30, 0) and DEVICES * MAX_RANKS_PER_GPU >= ranks:
        return dict(BASE_ENV, NCCL_MULTI_RANK_GPU_ENABLE="1")
    return None


needs_nccl = pytest.mark.skipif(DEVICES == 0 or not NCCL or shutil.which("mpirun") is None,
                                reason="needs a GPU, CuPy with NCCL and mpirun")


def _passed(proc, ranks: int, *marks: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for rank in range(ranks):
        for mark in (*marks, "device paths ok"):
            assert f"rank {rank}: {mark}" in proc.stdout, out


@needs_nccl
def test_inputs_are_kept_for_the_engines_stream():
    proc = run_mpi(1, WORKER, timeout=300, env=BASE_ENV, check=False)
    _passed(proc, 1, "inputs kept for the engine's stream")


@needs_nccl
@pytest.mark.skipif(ranks_env(4) is None,
                    reason="4 NCCL ranks need 4 GPUs, or 2 GPUs shared with NCCL >= 2.30")
@pytest.mark.parametrize("hierarchical", [False, True])
def test_fake_nodes_flat_by_default_and_horovods_gpu_adasum(hierarchical):
    flags = ["--fake-nodes"] + (["--hierarchical"] if hierarchical else [])
    proc = run_mpi(4, WORKER, *flags, timeout=300, env=ranks_env(4), check=False)
    _passed(proc, 4, f"fake nodes ok (hierarchical={hierarchical})")
