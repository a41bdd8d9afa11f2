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


# -- the ranks' decision at init (backends._nccl_backend), with stand-ins for CuPy and MPI ------


class _Recorder:
    """Stands in for NcclBackend: records how ``_nccl_backend`` built it."""

    def __init__(self, comm, device, **options):
        self.device, self.options = device, options


class _Comm:
    """Stands in for the MPI communicator: ``allgather`` returns ``others`` with this rank's
    entry at ``rank``."""

    def __init__(self, rank: int, others: list):
        self.rank, self.others = rank, others

    def allgather(self, mine):
        return self.others[:self.rank] + [mine] + self.others[self.rank:]


def _entry(node, bus="0000:01:00.0", *, problem=None, sharing=False, hierarchical=False):
    """Another rank's entry: (node index, bus id, devices, why not NCCL, flags of rank 0's)."""
    return (node, None if problem else bus, 1, problem, sharing, hierarchical)


@pytest.fixture
def decide(monkeypatch):
    """``decide(rank, others, node=0, env={})``: what ``_nccl_backend`` makes of a machine with
    one GPU on every rank, CuPy and NCCL 2.30 (stand-ins), and these other ranks."""
    import sys
    import types

    from hpc_horovod import backends
    from hpc_horovod.backends import nccl as nccl_module
    from hpc_horovod.common import gpu_layout, gpu_probe
    from hpc_horovod.common.topology import Topology

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(gpu_probe, "choose_device_backend", lambda: (NCCL, None))
    monkeypatch.setattr(gpu_probe, "nccl_built", lambda: 23007)
    monkeypatch.setattr(gpu_probe, "kernel_problem", lambda device: None)
    monkeypatch.setattr(gpu_layout, "device_bus_id", lambda device: "0000:01:00.0")
    monkeypatch.setattr(nccl_module, "NcclBackend", _Recorder)
    for name in ("HOROVOD_HIERARCHICAL_ALLREDUCE", "NCCL_MULTI_RANK_GPU_ENABLE",
                 "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)

    def run(rank, others, node=0, env=None):
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        size = len(others) + 1
        topo = Topology(rank, size, 0, 1, node, size, "same-host", "explicit")
        return backends._nccl_backend(topo, _Comm(rank, others))

    return run


def test_device_buffers_use_one_flat_nccl_communicator_unless_asked(decide):
    """The host backend's hierarchical default (on) does not reach device buffers: one flat
    NCCL communicator, with the node index kept for Adasum's node levels; an explicit
    HOROVOD_HIERARCHICAL_ALLREDUCE=1, rank 0's, turns the hierarchy on."""
    backend = decide(0, [_entry(1)], node=0)
    assert backend.options == {"node_id": 0, "hierarchical": False}
    backend = decide(1, [_entry(0)], node=1, env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"})
    assert backend.options == {"node_id": 1, "hierarchical": False}  # rank 0 did not ask
    backend = decide(1, [_entry(0, hierarchical=True)], node=1)
    assert backend.options == {"node_id": 1, "hierarchical": True}


def test_a_cupy_that_cannot_compile_kernels_keeps_every_rank_off_nccl(decide, monkeypatch):
    from hpc_horovod.common import gpu_probe

    text = gpu_probe.kernel_failure(OSError('cannot open source file "cuda_fp16.h"'), 13000)
    monkeypatch.setattr(gpu_probe, "kernel_problem", lambda device: text)
    with pytest.warns(RuntimeWarning, match="cuda_fp16.h"):
        assert decide(0, [_entry(1)], node=0) is None
    monkeypatch.setattr(gpu_probe, "kernel_problem", lambda device: None)
    assert decide(1, [_entry(0, problem=text)], node=1) is None  # rank 0's probe failed


def test_gpu_sharing_is_keyed_by_node_index_and_decided_by_rank_0(decide, monkeypatch):
    import os

    # same hostname, same bus id, different node index: different GPUs
    assert isinstance(decide(1, [_entry(0)], node=1), _Recorder)
    # one node: two ranks on one GPU, refused without rank 0's NCCL_MULTI_RANK_GPU_ENABLE=1
    assert decide(1, [_entry(0)], node=0, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"}) is None
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE")
    with pytest.warns(RuntimeWarning, match="several ranks would use one GPU"):
        assert decide(0, [_entry(0)], node=0) is None  # rank 0 says why
    assert isinstance(decide(1, [_entry(0, sharing=True)], node=0), _Recorder)
    assert os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"  # NCCL reads it on every rank
    # three ranks on one GPU: beyond what NCCL runs without hanging
    with pytest.warns(RuntimeWarning, match="up to 2 ranks per GPU"):
        assert decide(0, [_entry(0), _entry(0)], node=0,
                      env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"}) is None


def test_pin_gpu_accepts_the_sharing_nccl_allows(monkeypatch):
    from hpc_horovod.common import gpu_layout

    monkeypatch.setattr(gpu_layout, "_nccl_version", lambda: 23007)
    on = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    assert gpu_layout.select_gpu(1, 2, on, runtime_count=1) == 0
    with pytest.raises(gpu_layout.GpuLayoutError, match="up to 2 ranks per GPU"):
        gpu_layout.select_gpu(2, 3, on, runtime_count=1)
    with pytest.raises(gpu_layout.GpuLayoutError):
        gpu_layout.select_gpu(1, 2, {}, runtime_count=1)
    monkeypatch.setattr(gpu_layout, "_nccl_version", lambda: 22903)
    with pytest.raises(gpu_layout.GpuLayoutError):
        gpu_layout.select_gpu(1, 2, on, runtime_count=1)
