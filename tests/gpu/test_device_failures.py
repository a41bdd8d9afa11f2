"""On GPUs, the two defects of the device path that a first multi-rank run hits: half-precision
averages scaled by a factor rounded to the half type, and a peer that dies while collectives
are in flight on the device. Three ranks where there are three GPUs, else two: one per GPU, or
sharing one GPU with NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL documents hangs beyond
2 ranks per GPU); skipped otherwise (NCCL refuses). Every run has a timeout.
The CPU side of both (the scaling dtype, the abort through a stand-in communicator) is checked
in tests/common/test_gpu_failures.py."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from support import run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
HERE = Path(__file__).parent
DEVICES = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl_version() -> int:
    from hpc_horovod.common.basics import nccl_built

    return nccl_built() if DEVICES else 0


NCCL = _nccl_version()


#: Open MPI's UCX one-sided component may abort on machines without a UCX network
BASE_ENV = {"OMPI_MCA_osc": "^ucx"}


def ranks_and_env() -> tuple[int, dict] | None:
    """How many NCCL ranks this machine runs for these tests (3, else 2) and their environment;
    None when NCCL cannot run two."""
    from hpc_horovod.common.gpu_probe import nccl_version_tuple

    if DEVICES >= 2:
        return min(DEVICES, 3), dict(BASE_ENV)
    if DEVICES and NCCL and nccl_version_tuple(NCCL) >= (2, 30, 0):
        return 2, dict(BASE_ENV, NCCL_MULTI_RANK_GPU_ENABLE="1")  # at most 2 per GPU
    return None


RUN = ranks_and_env() if DEVICES and NCCL else None
needs_ranks = pytest.mark.skipif(
    RUN is None or shutil.which("mpirun") is None,
    reason="needs CuPy with NCCL, mpirun, and 2 GPUs or NCCL >= 2.30 (2 ranks sharing a GPU)")


@needs_ranks
def test_half_averages_equal_the_float32_reference():
    """torch_device_worker.py's exact rows: bfloat16 and float16 Average over the ranks (alone,
    in place, fused) equal (float32 sum * float32(1/size)) rounded once, bit for bit."""
    ranks, env = RUN
    proc = run_mpi(ranks, HERE / "torch_device_worker.py", "--expect", "nccl", timeout=600,
                   env=env, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "exact" in out  # the exact rows ran (they are named "... exact")
    for rank in range(ranks):
        assert f"rank {rank}: torch device ok" in proc.stdout, out


@needs_ranks
@pytest.mark.parametrize("scenario", ["kill", "linger"])
def test_a_peer_that_dies_mid_step_ends_the_job_naming_it(scenario, tmp_path):
    mark = tmp_path / "failed_at"
    ranks, env = RUN
    env = dict(env, JOB_END_MARK=str(mark), HOROVOD_PEER_TIMEOUT_SECONDS="30")
    proc = run_mpi(ranks, HERE / "peer_dies_worker.py", scenario, timeout=300, env=env,
                   check=False)
    ended = time.time()
    out = re.sub(r"\[1,\d+\]<std(?:out|err)>:", "", proc.stdout + proc.stderr)
    assert proc.returncode != 0, out
    assert "not stopped" not in out and "lingered to the end" not in out, out
    took = ended - float(mark.read_text())
    if scenario == "kill":
        assert "rank 1" in out and "signal 9" in out, out
        assert took < 60, f"{took:.1f} s\n{out}"
    else:
        # the other ranks left their device wait by themselves (rank 1 still lived), and the
        # job ended long before rank 1's 90 s, saying that rank 1 failed
        for rank in (r for r in range(ranks) if r != 1):
            assert f"rank {rank}: released after" in out, out
        assert "rank 1 failed first: RuntimeError: rank 1 fails on purpose" in out, out
        assert took < 60, f"{took:.1f} s\n{out}"
