"""Which transport device buffers use (NCCL, CUDA-aware MPI, host staging), and the detection of
CUDA-aware MPI against this machine's real Open MPI (built without CUDA)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import ROOT, mpi_env

from hpc_horovod.common.basics import cuda_built, nccl_built
from hpc_horovod.common.gpu import (
    MPI_CUDA_AWARE,
    MPI_STAGED,
    NCCL,
    choose_device_backend,
    cuda_aware_mpi,
    fallback_warning,
    nccl_version_tuple,
    parse_ompi_info,
    select_device_backend,
)


@pytest.mark.parametrize("code, expected", [
    (22703, (2, 27, 3)), (21903, (2, 19, 3)), (20901, (2, 9, 1)), (2708, (2, 7, 8)),
    (2604, (2, 6, 4)), (0, (0, 0, 0)),
])
def test_nccl_version_codes(code, expected):
    assert nccl_version_tuple(code) == expected


@pytest.mark.parametrize("cupy, version, aware, expected", [
    (True, 22703, False, NCCL),
    (True, 22703, True, NCCL),
    (True, 2708, False, NCCL),
    (True, 2604, True, MPI_CUDA_AWARE),  # no ncclSend/ncclRecv before 2.7
    (True, 2604, False, MPI_STAGED),
    (True, 0, True, MPI_CUDA_AWARE),
    (False, 22703, False, MPI_STAGED),  # NCCL without CuPy cannot be driven
    (False, 0, True, MPI_CUDA_AWARE),
    (False, 0, False, MPI_STAGED),
])
def test_select_device_backend(cupy, version, aware, expected):
    assert select_device_backend(cupy, version, aware) == expected


def test_fallback_warning_says_why_and_how():
    assert fallback_warning(NCCL, True, 22703) is None
    text = fallback_warning(MPI_STAGED, False, 0)
    assert "CuPy is not installed" in text and "cupy-cuda1" in text
    assert "host memory" in text
    text = fallback_warning(MPI_CUDA_AWARE, True, 0)
    assert "nvidia-nccl-cu1" in text and "CUDA-aware MPI" in text
    text = fallback_warning(MPI_STAGED, True, 2604)
    assert "NCCL 2.6.4 is older than 2.7.0" in text


def test_parse_ompi_info():
    line = "mca:mpi:base:param:mpi_built_with_cuda_support:value:{}"
    assert parse_ompi_info("x:y\n" + line.format("true") + "\n") is True
    assert parse_ompi_info(line.format("false")) is False
    assert parse_ompi_info("mca:btl:tcp:param:btl_tcp_if_include:value:") is None


def test_cuda_aware_mpi_is_false_for_this_open_mpi():
    out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True, text=True,
                         check=True).stdout
    assert parse_ompi_info(out) is False  # Debian's Open MPI is built without CUDA
    assert cuda_aware_mpi() is False


def test_cuda_aware_mpi_asks_the_initialized_library():
    # MPIX_Query_cuda_support of the libmpi mpi4py loaded, in a fresh MPI process.
    code = ("from mpi4py import MPI\n"
            "from hpc_horovod.common import gpu\n"
            "print(gpu._mpix_query_cuda_support(), gpu.cuda_aware_mpi())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=mpi_env(), cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]


def test_choose_device_backend_on_this_installation():
    choice, warning = choose_device_backend()
    expected = select_device_backend(cuda_built(), nccl_built(), False)
    assert choice == expected
    assert (warning is None) == (choice == NCCL)
