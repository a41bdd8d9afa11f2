"""Which GPU this rank uses, and how device buffers move when NCCL is not there.

Pinning follows Horovod's rule, device = local rank modulo the devices this process sees, with
the devices read from ``CUDA_VISIBLE_DEVICES`` when it is set (so that no CUDA context is created
just to count them) and from the framework's runtime otherwise. A SLURM step started with
``--gpus-per-task=1`` shows each task exactly one device, which the same rule maps to index 0.
The layouts that cannot work (two ranks on one GPU, which NCCL refuses; no GPU although the job
asked for some) raise :class:`GpuLayoutError` naming the ``srun`` options that fix them.

Device buffers travel through NCCL when CuPy has it, else through MPI: directly when MPI is
CUDA-aware, staged through host memory otherwise (:func:`select_device_backend`).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import subprocess
import sys
from collections.abc import Mapping

import numpy as np

from .errors import TopologyError

#: NCCL 2.7 brought ncclSend/ncclRecv, which alltoall needs.
NCCL_MIN_VERSION = (2, 7, 0)
NCCL = "nccl"
MPI_CUDA_AWARE = "mpi-cuda-aware"
MPI_STAGED = "mpi-staged"

#: Variables by which SLURM says that the job or step holds GPUs on this node.
_SLURM_GPU_VARIABLES = ("SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS",
                        "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_NODE", "SLURM_GPUS")


class GpuLayoutError(TopologyError):
    """The ranks of a node cannot each get a GPU of their own; the message says how to fix it."""


# -- pinning ------------------------------------------------------------------------------------
def parse_visible_devices(value: str) -> list[str]:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value, as the CUDA runtime reads them.

    Entries are indices or ``GPU-``/``MIG-`` UUIDs; the runtime stops at the first entry that is
    neither (SLURM's ``NoDevFiles``, ``-1``), which hides that entry and all that follow.
    """
    entries = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.startswith(("GPU-", "MIG-")) or entry.isdigit():
            entries.append(entry)
        else:
            break
    return entries


def visible_device_count(env: Mapping[str, str], runtime_count: int | None = None) -> int | None:
    """How many devices this process sees: the runtime's count when one was asked, else the
    length of ``CUDA_VISIBLE_DEVICES``; None when neither is known."""
    if runtime_count is not None:
        return runtime_count
    if "CUDA_VISIBLE_DEVICES" in env:
        return len(parse_visible_devices(env["CUDA_VISIBLE_DEVICES"]))
    return None


def gpus_requested(env: Mapping[str, str]) -> str | None:
    """The SLURM variable (as ``NAME=value``) that shows the job holds GPUs here, else None."""
    for name in _SLURM_GPU_VARIABLES:
        value = env.get(name, "").strip()
        if value and value not in ("0", "(null)"):
            return f"{name}={value}"
    return None


def per_task_binding(env: Mapping[str, str]) -> bool:
    """True when SLURM gives each task its own GPUs (``--gpus-per-task`` or ``--gpu-bind``),
    so that the devices one task sees are not shared with the other tasks of the node."""
    if env.get("SLURM_GPUS_PER_TASK", "").strip():
        return True
    bind = env.get("SLURM_GPU_BIND", "").strip().lower()
    return bool(bind) and bind.split(",")[-1] != "none"


def select_gpu(local_rank: int, local_size: int, env: Mapping[str, str],
               runtime_count: int | None = None, *, exclusive: bool = True) -> int | None:
    """The device index (within the visible devices) for this rank, or None for a CPU rank.

    ``exclusive`` (what NCCL needs) makes two ranks on one GPU an error; pass False when the
    ranks may share devices (MPI transport only).
    """
    count = visible_device_count(env, runtime_count)
    shown = env.get("CUDA_VISIBLE_DEVICES")
    where = ("CUDA_VISIBLE_DEVICES is not set" if shown is None
             else f"CUDA_VISIBLE_DEVICES={shown!r}")
    if count is None:
        return local_rank
    if count == 0:
        requested = gpus_requested(env)
        if requested is None:
            return None
        raise GpuLayoutError(
            f"the job holds GPUs on this node ({requested}) but this process sees none "
            f"({where}). Ask for GPUs on the step itself (`srun --gpus-per-task=1 ...`, or "
            "`--gres=gpu:N` on the srun line when the step does not inherit the job's GPUs), "
            "and check that the CUDA driver works on the node (`srun nvidia-smi`)."
        )
    if exclusive and local_size > count and not per_task_binding(env):
        raise GpuLayoutError(
            f"{local_size} ranks run on this node but they see only {count} GPU(s) ({where}): "
            "two ranks would share one GPU, which NCCL refuses. Start one rank per GPU: "
            f"`--ntasks-per-node={count}` (the number of GPUs per node), or give each task its "
            "own GPU with `srun --gpus-per-task=1`."
        )
    return local_rank % count


def _runtime_count(framework: str | None) -> int | None:
    """The device count reported by an already-loaded framework (no import, no CUDA init for
    frameworks that count through NVML)."""
    if framework in (None, "torch") and "torch" in sys.modules:
        torch = sys.modules["torch"]
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    if framework in (None, "cupy") and "cupy" in sys.modules:
        cupy = sys.modules["cupy"]
        try:
            return int(cupy.cuda.runtime.getDeviceCount())
        except cupy.cuda.runtime.CUDARuntimeError:
            return 0
    if framework in (None, "tensorflow") and "tensorflow" in sys.modules:
        return len(sys.modules["tensorflow"].config.list_physical_devices("GPU"))
    return None


def pin_gpu(framework: str | None = None, *, exclusive: bool = True) -> int | None:
    """Make this rank use its own GPU; returns the device index, or None on a CPU-only rank.

    ``framework``: "torch" (``torch.cuda.set_device``), "cupy" (``cupy.cuda.Device(d).use()``)
    or "tensorflow" (``tf.config.set_visible_devices``); None pins every one of them that is
    already imported. Call it after ``hvd.init()``.
    """
    from . import basics

    if framework not in (None, "torch", "cupy", "tensorflow"):
        raise ValueError(f"pin_gpu: unknown framework {framework!r}; use 'torch', 'cupy', "
                         "'tensorflow' or None")
    if framework is not None:
        importlib.import_module(framework)
    env = os.environ
    runtime = None if "CUDA_VISIBLE_DEVICES" in env else _runtime_count(framework)
    device = select_gpu(basics.local_rank(), basics.local_size(), env, runtime,
                        exclusive=exclusive)
    if device is None:
        return None
    loaded = [name for name in ("torch", "cupy", "tensorflow")
              if (framework in (None, name)) and name in sys.modules]
    for name in loaded:
        module = sys.modules[name]
        if name == "torch":
            module.cuda.set_device(device)
        elif name == "cupy":
            module.cuda.Device(device).use()
        else:
            gpus = module.config.list_physical_devices("GPU")
            module.config.set_visible_devices(gpus[device], "GPU")
    return device


# -- device transport selection -----------------------------------------------------------------
def nccl_version_tuple(code: int) -> tuple[int, int, int]:
    """(major, minor, patch) of an NCCL version code (2.9+ encodes 2.19.3 as 21903; older
    releases encoded 2.7.8 as 2708)."""
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def select_device_backend(cupy_available: bool, nccl_version: int, cuda_aware_mpi: bool) -> str:
    """How device buffers move: ``"nccl"``, ``"mpi-cuda-aware"`` or ``"mpi-staged"``."""
    if cupy_available and nccl_version and nccl_version_tuple(nccl_version) >= NCCL_MIN_VERSION:
        return NCCL
    return MPI_CUDA_AWARE if cuda_aware_mpi else MPI_STAGED


def fallback_warning(choice: str, cupy_available: bool, nccl_version: int) -> str | None:
    """The one warning to show at init when GPU buffers cannot use NCCL (None when they can)."""
    if choice == NCCL:
        return None
    if not cupy_available:
        why = "CuPy is not installed (`pip install hpc-horovod[cuda]`)"
    elif not nccl_version:
        why = "CuPy finds no NCCL library (`pip install nvidia-nccl-cu12`)"
    else:
        found = ".".join(map(str, nccl_version_tuple(nccl_version)))
        need = ".".join(map(str, NCCL_MIN_VERSION))
        why = f"NCCL {found} is older than {need}"
    how = ("through CUDA-aware MPI" if choice == MPI_CUDA_AWARE
           else "through host memory over MPI (slower: each buffer is copied to the host and back)")
    return f"GPU tensors will not use NCCL because {why}; they move {how}."


def parse_ompi_info(text: str) -> bool | None:
    """Open MPI's answer in ``ompi_info --parsable --all``: was it built with CUDA support?"""
    for line in text.splitlines():
        if "mpi_built_with_cuda_support:value:" in line:
            return line.rsplit(":", 1)[1].strip() == "true"
    return None


def _mpix_query_cuda_support() -> bool | None:
    """``MPIX_Query_cuda_support()`` of the libmpi mpi4py loaded (Open MPI, MPICH 4), only once
    MPI is initialized (before, Open MPI answers its default, not its configuration)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized():
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    except OSError:
        return None
    for path in sorted(paths):
        query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
    return None


def cuda_aware_mpi() -> bool:
    """Whether MPI accepts device pointers: the library's own runtime answer when it has one,
    else what ``ompi_info`` says about the build; False when neither can tell."""
    answer = _mpix_query_cuda_support()
    if answer is not None:
        return answer
    try:
        out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return bool(parse_ompi_info(out))


def choose_device_backend() -> tuple[str, str | None]:
    """This installation's transport for device buffers and the warning to show once at init
    (None when NCCL is used)."""
    from .basics import cuda_built, nccl_built

    cupy_available, version = cuda_built(), nccl_built()
    if select_device_backend(cupy_available, version, cuda_aware_mpi=False) == NCCL:
        return NCCL, None
    choice = select_device_backend(cupy_available, version, cuda_aware_mpi())
    return choice, fallback_warning(choice, cupy_available, version)


def array_module(array):
    """numpy for host arrays, cupy for device arrays: the module that allocates alongside."""
    if isinstance(array, np.ndarray):
        return np
    return importlib.import_module("cupy")
