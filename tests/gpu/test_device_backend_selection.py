"""Which transport device buffers use: NCCL, or host memory over MPI, and the warning that says
why and what to install."""

from __future__ import annotations

import pytest

from hpc_horovod.common.basics import cuda_built, nccl_built
from hpc_horovod.common.gpu_probe import (
    MPI_STAGED,
    NCCL,
    choose_device_backend,
    fallback_warning,
    kernel_failure,
    nccl_version_tuple,
    select_device_backend,
)


@pytest.mark.parametrize("code, expected", [
    (22703, (2, 27, 3)), (21903, (2, 19, 3)), (20901, (2, 9, 1)), (2708, (2, 7, 8)),
    (2604, (2, 6, 4)), (0, (0, 0, 0)),
])
def test_nccl_version_codes(code, expected):
    assert nccl_version_tuple(code) == expected


@pytest.mark.parametrize("cupy, version, expected", [
    (True, 22703, NCCL),
    (True, 2708, NCCL),
    (True, 2604, MPI_STAGED),  # no ncclSend/ncclRecv before 2.7
    (True, 0, MPI_STAGED),
    (False, 22703, MPI_STAGED),  # NCCL without CuPy cannot be driven
    (False, 0, MPI_STAGED),
])
def test_select_device_backend(cupy, version, expected):
    assert select_device_backend(cupy, version) == expected


def test_fallback_warning_says_why_and_how():
    assert fallback_warning(NCCL, True, 22703) is None
    text = fallback_warning(MPI_STAGED, False, 0)
    assert "CuPy is not installed" in text and "cupy-cuda1" in text
    assert "host memory" in text
    text = fallback_warning(MPI_STAGED, True, 0)
    assert "nvidia-nccl-cu1" in text and "host memory" in text and "CUDA-aware" not in text
    text = fallback_warning(MPI_STAGED, True, 2604)
    assert "NCCL 2.6.4 is older than 2.7.0" in text


def test_a_kernel_that_does_not_compile_says_what_to_install():
    """The message of the one-process kernel probe (``gpu_probe.kernels_work``) for the two
    usual failures, a missing NVRTC and a missing CUDA header; the probe itself runs on a GPU
    (tests/gpu/torch_device_worker.py)."""
    assert kernel_failure(None, 13000) is None
    missing = RuntimeError("CuPy failed to load libnvrtc.so.13: cannot open shared object")
    text = kernel_failure(missing, 13000)
    assert "libnvrtc.so.13" in text and "cupy-cuda13x[ctk]" in text
    assert "nvidia-cuda-nvrtc-cu13" in text and "host memory" in text
    header = OSError("catastrophic error: cannot open source file \"cuda_fp16.h\"\n...")
    text = kernel_failure(header, 12080)
    assert "cuda_fp16.h" in text and "cupy-cuda12x[ctk]" in text and "\n" not in text


def test_choose_device_backend_on_this_installation():
    choice, warning = choose_device_backend()
    expected = select_device_backend(cuda_built(), nccl_built())
    assert choice == expected
    assert (warning is None) == (choice == NCCL)
