"""The checks of ``check-build --gpu`` (``tests/gpu/torch_device_worker.py``) run on CPU
tensors: their expected results, computed on the CPU from every rank's inputs, must match what
the engine computes on the host, alone and on two MPI ranks. This checks the checks, not a GPU:
a failure on a GPU then points at the device path. Nothing here touches CUDA."""

from __future__ import annotations

import importlib.util
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


def test_the_gpu_table_shows_versions_failures_and_bandwidth():
    """The table's layout, from made-up rows and timings (no GPU measured anything here)."""
    from hpc_horovod.gpu_check import gpu_table, multi_rank_note

    rows = [("allreduce float32 Average", True, ""), ("Adasum", False, "AssertionError: x"),
            ("alltoall with splits", True, "")]
    failures = [[("Adasum", "AssertionError: x")], [], [("alltoall with splits", "boom")]]
    text = gpu_table([("torch", "2.11"), ("NCCL", "2.30.1")], 3, "nccl", "3 GPUs", rows,
                     failures, [])
    assert "  torch    2.11" in text and "transport nccl" in text
    assert "allreduce float32 Average" in text and "PASS" in text
    assert "Adasum" in text and "FAIL on rank(s) 0  (AssertionError: x)" in text
    assert "FAIL on rank(s) 2  (boom)" in text and "SOME DEVICE OPS FAILED" in text
    text = gpu_table([], 4, "nccl", "", rows[:1], [[], [], [], []],
                     [(64, 0.002, 0.0019), (1, 0.001, None)])
    # 64 MiB in 2 ms on 4 ranks: algbw 33.55 GB/s, busbw x 1.5 = 50.3
    assert "hvd busbw" in text and "50.3" in text and "0.95" in text and "n/a" in text
    assert "all device ops passed" in text
    one = gpu_table([], 1, "single", "", rows[:1], [[]], [(1, 0.001, 0.001)])
    assert "hvd algbw" in one and "1.0" in one
    assert "no GPU" in multi_rank_note(0, 0)
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in multi_rank_note(23001, 1)
    assert "refuses two ranks" in multi_rank_note(22903, 1)
    assert "one rank per GPU" in multi_rank_note(22903, 4)


def test_the_bandwidth_rows_time_named_allreduces_on_cpu_tensors():
    """The bandwidth loop of ``check-build --gpu`` on CPU tensors, one process: a row per size,
    hpc_horovod's time positive, no raw NCCL to compare with (no CuPy here), and every call
    of a size under one name (cached after its first negotiation, as a training step's
    buckets are; an unnamed op would be negotiated in full every time)."""
    import torch

    import hpc_horovod.torch as hvd
    from hpc_horovod.gpu_check import GpuCheck

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: the raw NCCL column would be measured")
    names = []

    class Recording:
        def __getattr__(self, attr):
            return getattr(hvd, attr)

        def allreduce_(self, tensor, **kwargs):
            names.append(kwargs.get("name"))
            return hvd.allreduce_(tensor, **kwargs)

    hvd.init()
    try:
        rows = GpuCheck(Recording(), torch, device="cpu").bandwidth(sizes_mib=(1, 2),
                                                                    iterations=3)
    finally:
        hvd.shutdown()
    assert [mib for mib, _, _ in rows] == [1, 2]
    assert all(hvd_s > 0 and raw_s is None for _, hvd_s, raw_s in rows)
    assert names == ["gpu_check.bandwidth.1"] * 6 + ["gpu_check.bandwidth.2"] * 6
