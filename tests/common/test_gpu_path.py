"""The GPU path's decisions, checked where there is no GPU: which ranks would share a device,
which packages to name, when CUDA tensors go to the engine as device views, how Adasum and the
inter-node step stage their buffers, and what the errors say. Each test below stands in for a
GPU run only for the decision it names; the device work itself is checked in ``tests/gpu``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
from support import ROOT, mpi_env

from hpc_horovod.backends.nccl import mpi_wire_dtype
from hpc_horovod.backends.single import SingleBackend
from hpc_horovod.common import gpu_layout, gpu_probe, gpu_stream
from hpc_horovod.common.collectives import adasum_host_input, adasum_one
from hpc_horovod.common.execution import laid_end_to_end
from hpc_horovod.common.request import Request, signature_of
from hpc_horovod.common.types import Adasum, Max, Min, Product, Sum, bfloat16


# -- which GPU, and who shares one --------------------------------------------------------------
def test_a_launcher_that_sets_one_device_per_rank_is_not_sharing():
    """Stands in for 4 ranks on a 4-GPU node whose launcher exports CUDA_VISIBLE_DEVICES=k per
    rank outside SLURM: each sees one device, index 0, and no rank may call it sharing."""
    for local_rank in range(4):
        env = {"CUDA_VISIBLE_DEVICES": str(local_rank)}
        assert gpu_layout.select_gpu(local_rank, 4, env) == 0


def test_sharing_is_certain_when_every_rank_sees_the_same_devices():
    with pytest.raises(gpu_layout.GpuLayoutError, match="2 ranks run on this node"):
        gpu_layout.select_gpu(1, 2, {}, runtime_count=1)
    slurm = {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_STEP_GPUS": "0,1"}
    with pytest.raises(gpu_layout.GpuLayoutError, match="--gpus-per-task=1"):
        gpu_layout.select_gpu(3, 4, slurm)
    assert gpu_layout.select_gpu(3, 4, dict(slurm, SLURM_GPUS_PER_TASK="1")) == 1
    assert gpu_layout.same_devices_on_node({}) and not gpu_layout.same_devices_on_node(
        {"CUDA_VISIBLE_DEVICES": "0"})


def test_shared_gpus_compares_physical_devices_per_node():
    entries = [("n1", "0000:1A:00.0"), ("n1", "0000:1b:00.0"), ("n2", "0000:1A:00.0"),
               ("n1", "0000:1a:00.0"), ("n2", None)]
    assert gpu_layout.shared_gpus(entries) == [[0, 3]]
    assert gpu_layout.shared_gpus([("n1", "A"), ("n2", "A"), ("n1", "B")]) == []
    text = gpu_layout.sharing_message([[0, 3]], entries)
    assert "ranks 0, 3 on GPU 0000:1A:00.0" in text and "Duplicate GPU detected" in text
    assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in text and "--gpus-per-task=1" in text


def test_several_ranks_per_gpu_only_from_nccl_2_30_with_the_variable():
    on = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    assert gpu_layout.multi_rank_gpu_allowed(23000, on)
    assert not gpu_layout.multi_rank_gpu_allowed(23000, {})
    assert not gpu_layout.multi_rank_gpu_allowed(22903, on)
    assert not gpu_layout.multi_rank_gpu_allowed(0, on)


def test_a_cuda_tensor_on_another_gpu_than_the_ranks_is_refused():
    gpu_layout.check_tensor_device(2, 2, "allreduce")
    with pytest.raises(ValueError) as info:
        gpu_layout.check_tensor_device(1, 0, "allreduce")
    text = str(info.value)
    assert "cuda:1" in text and "cuda:0" in text and "torch.cuda.set_device" in text


def test_group_device_is_the_backends_else_the_arrays():
    """Stands in for an NCCL backend (which has ``device``) and for one process's backend (which
    has none); the arrays' device is read only in the latter case."""
    assert gpu_stream.group_device(SimpleNamespace(device=3), [None]) == 3
    with pytest.raises(ValueError, match="without a device array"):
        gpu_stream.group_device(SingleBackend(), [None])


# -- packages and versions ------------------------------------------------------------------------
def test_install_hints_follow_the_cuda_major_version():
    assert gpu_probe.cupy_package(13000) == "cupy-cuda13x"
    assert gpu_probe.nccl_package(13000) == "nvidia-nccl-cu13"
    assert gpu_probe.nccl_package(12080) == "nvidia-nccl-cu12"
    assert "cupy-cuda12x or cupy-cuda13x" in gpu_probe.install_hint(None)
    assert "nvidia-nccl-cu12 or nvidia-nccl-cu13" in gpu_probe.install_hint(None)


def test_bfloat16_on_the_device_needs_cupy_14_numpy_2_1_2_and_ml_dtypes():
    assert gpu_probe.cupy_takes_bfloat16("14.2.0", "2.1.2", True)
    assert gpu_probe.cupy_takes_bfloat16("14.0.0rc1", "2.3.0", True)
    assert not gpu_probe.cupy_takes_bfloat16("13.6.0", "2.3.0", True)
    assert not gpu_probe.cupy_takes_bfloat16("14.2.0", "2.1.1", True)
    assert not gpu_probe.cupy_takes_bfloat16("14.2.0", "2.3.0", False)


def test_fallback_warning_names_the_nccl_package_of_this_cuda():
    text = gpu_probe.fallback_warning(gpu_probe.MPI_STAGED, True, 0)
    assert f"pip install {gpu_probe.nccl_package(gpu_probe.cuda_runtime_version())}" in text
    assert "cupy-cuda1" in gpu_probe.fallback_warning(gpu_probe.MPI_STAGED, False, 0)


# -- staging decisions ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, op, wire", [
    (np.float16, Sum, np.float32), (bfloat16, Max, np.float32), (np.int8, Sum, np.int64),
    (np.uint8, Product, np.int64), (np.int16, Sum, np.int64), (np.uint8, Max, np.uint8),
    (np.int32, Sum, np.int32), (np.float32, Min, np.float32),
])
def test_the_inter_node_step_widens_before_mpi_reads(dtype, op, wire):
    assert mpi_wire_dtype(dtype, op) == np.dtype(wire)


def test_laid_end_to_end():
    assert laid_end_to_end([100], [8])
    assert laid_end_to_end([100, 108, 116], [8, 8, 4])
    assert not laid_end_to_end([100, 112], [8, 8])
    assert not laid_end_to_end([108, 100], [8, 8])


class _GatherTypes(SingleBackend):
    """One process's backend that records the array types Adasum hands to ``allgatherv``."""

    def __init__(self):
        self.seen = []

    def allgatherv(self, send, recv, counts) -> None:
        self.seen.append((type(send), type(recv)))
        super().allgatherv(send, recv, counts)


def test_adasum_gathers_host_arrays_on_both_sides():
    """Stands in for the device case only in what reaches the backend: both buffers of the
    gather are numpy, so no backend takes its device branch with a host receive buffer."""
    tensor = np.arange(6, dtype=np.float32).reshape(2, 3)
    sig = signature_of("allreduce", tensor, Adasum, prescale=2.0)
    req = Request("a", tensor, sig)
    backend = _GatherTypes()
    adasum_one(backend, sig, req)
    assert backend.seen == [(np.ndarray, np.ndarray)]
    np.testing.assert_allclose(req.result, tensor * 2.0)
    zeros = adasum_host_input(None, 4, 3.0)
    assert zeros.dtype == np.float64 and not zeros.any()
    np.testing.assert_array_equal(adasum_host_input(tensor, 6, 0.5), tensor.reshape(-1) * 0.5)


# -- the torch binding without CuPy ---------------------------------------------------------------
def test_one_process_needs_nothing_beyond_torch():
    """With CuPy hidden (its import fails), one process sends CUDA tensors through host memory
    and never imports CuPy; NCCL jobs still use device views. Stands in for a GPU only in the
    choice: CUDA tensors themselves need the GPU test (tests/gpu/torch_device_worker.py)."""
    script = textwrap.dedent("""
        import sys
        sys.modules["cupy"] = None  # any import of cupy raises ImportError
        import torch
        import hpc_horovod.torch as hvd
        from hpc_horovod.common import gpu_probe
        from hpc_horovod.torch import adapter
        hvd.init()
        assert gpu_probe.cupy_or_none() is None
        assert not adapter.device_views("single", torch.float32, 0)
        assert not adapter.device_views("host", torch.float32, 0)
        assert adapter.device_views("nccl", torch.float32, 0)
        assert not adapter.device_views("nccl", torch.bfloat16, 0)  # no CuPy to take it
        out = hvd.allreduce(torch.ones(4), op=hvd.Sum)
        assert out.tolist() == [1.0] * 4
        hvd.shutdown()
        print("ok")
    """)
    env = {k: v for k, v in mpi_env().items()
           if not k.startswith(("OMPI_COMM", "PMI", "PMIX", "SLURM_"))}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_the_nccl_backend_touches_no_device_until_its_first_device_collective():
    """Where CuPy and NCCL are installed but no CUDA driver is (any CUDA call fails here),
    building the backend, reducing host buffers over MPI and freeing it must still work: init
    creates no stream, no communicator and no context (GPU 7 does not even exist)."""
    nccl = pytest.importorskip("cupy.cuda.nccl", reason="cupy is not installed")
    if not nccl.available:
        pytest.skip("cupy finds no NCCL library")
    from mpi4py import MPI

    from hpc_horovod.backends.mpi import MpiBackend
    from hpc_horovod.backends.nccl import NcclBackend
    from hpc_horovod.backends.routed import RoutedBackend

    backend = RoutedBackend(MpiBackend(MPI.COMM_SELF.Dup()), NcclBackend(MPI.COMM_SELF.Dup(), 7))
    host = np.arange(4, dtype=np.float32)
    backend.allreduce(host, Sum)
    np.testing.assert_array_equal(host, np.arange(4, dtype=np.float32))
    assert backend.device == 7
    backend.free()


def test_the_unpack_kernel_copies_every_segment_to_its_output(tmp_path):
    """The source of the kernel that copies a reduced fusion buffer out (``execution.py``),
    compiled for the CPU by the C compiler, with loops over blocks and threads standing in for
    the CUDA grid (a small grid, so that each thread strides over several elements). Checks
    its indexing only: empty segments, a dropped output (a joined rank's share), the last
    element. The CUDA build of the same source runs in tests/gpu."""
    import shutil

    from hpc_horovod.common.execution import _UNPACK_ITEMS, _UNPACK_SOURCE

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    kernel = _UNPACK_SOURCE.replace("ITEM", _UNPACK_ITEMS[4]).replace('extern "C" ', "")
    ends = [3, 3, 7, 8, 12]
    harness = textwrap.dedent("""
        #include <stdio.h>
        struct dim { long long x; };
        static struct dim blockIdx, threadIdx, blockDim = {3}, gridDim = {2};
        #define __global__
        %s
        int main(void) {
            long long ends[] = {%s};
            unsigned int src[12], o0[3], o2[4], o3[1], o4[4], *outs[5] = {o0, 0, o2, o3, 0};
            outs[4] = o4;
            outs[3] = 0;  /* dropped */
            for (int i = 0; i < 12; i++) src[i] = 100 + i;
            for (blockIdx.x = 0; blockIdx.x < gridDim.x; blockIdx.x++)
                for (threadIdx.x = 0; threadIdx.x < blockDim.x; threadIdx.x++)
                    hpc_horovod_unpack(src, (unsigned int* const*)outs, ends, 5, 12);
            for (int i = 0; i < 3; i++) printf("%%u ", o0[i]);
            for (int i = 0; i < 4; i++) printf("%%u ", o2[i]);
            for (int i = 0; i < 4; i++) printf("%%u ", o4[i]);
            printf("\\n");
            return 0;
        }
    """) % (kernel, ", ".join(map(str, ends)))
    source = tmp_path / "unpack.c"
    source.write_text(harness)
    binary = tmp_path / "unpack"
    subprocess.run([compiler, "-O1", "-o", str(binary), str(source)], check=True,
                   capture_output=True, text=True)
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    expected = list(range(100, 103)) + list(range(103, 107)) + list(range(108, 112))
    assert out.split() == [str(v) for v in expected]
