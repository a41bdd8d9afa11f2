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

import contextlib
import ctypes
import functools
import importlib
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

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


def same_devices_on_node(env: Mapping[str, str]) -> bool:
    """True when every rank of the node certainly sees the same devices as this one: no
    ``CUDA_VISIBLE_DEVICES`` (all the node's devices), or SLURM set it for the whole step
    (GPUs held, no per-task binding). A launcher may also set ``CUDA_VISIBLE_DEVICES`` per rank
    (one device each): only comparing the ranks' devices tells then (:func:`shared_gpus`)."""
    if "CUDA_VISIBLE_DEVICES" not in env:
        return True
    return gpus_requested(env) is not None and not per_task_binding(env)


def select_gpu(local_rank: int, local_size: int, env: Mapping[str, str],
               runtime_count: int | None = None, *, exclusive: bool = True) -> int | None:
    """The device index (within the visible devices) for this rank, or None for a CPU rank.

    ``exclusive`` (what NCCL needs) makes two ranks on one GPU an error where this process
    alone can tell (:func:`same_devices_on_node`); pass False when the ranks may share devices
    (MPI transport only). ``init`` compares the ranks' devices themselves (:func:`shared_gpus`).
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
    if exclusive and local_size > count and same_devices_on_node(env):
        raise GpuLayoutError(
            f"{local_size} ranks run on this node but they see only {count} GPU(s) ({where}): "
            "two ranks would share one GPU, which NCCL refuses. Start one rank per GPU: "
            f"`--ntasks-per-node={count}` (the number of GPUs per node), or give each task its "
            "own GPU with `srun --gpus-per-task=1`."
        )
    return local_rank % count


def runtime_count(framework: str | None) -> int | None:
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
        why = f"CuPy is not installed ({install_hint(cuda_runtime_version())})"
    elif not nccl_version:
        why = (f"CuPy finds no NCCL library (`pip install "
               f"{nccl_package(cuda_runtime_version())}`, or load the cluster's NCCL)")
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


# -- packages ---------------------------------------------------------------------------------
def cuda_major(runtime_version: int | None) -> int | None:
    """The CUDA major version of a runtime version code (12080 -> 12), None when unknown."""
    return runtime_version // 1000 if runtime_version else None


def cupy_package(runtime_version: int | None) -> str:
    """The CuPy wheel for this CUDA: ``cupy-cuda12x`` or ``cupy-cuda13x``; when the CUDA
    version is unknown, both are named."""
    major = cuda_major(runtime_version)
    return f"cupy-cuda{major}x" if major else "cupy-cuda12x or cupy-cuda13x (as `nvidia-smi` says)"


def nccl_package(runtime_version: int | None) -> str:
    """The NCCL wheel for this CUDA: ``nvidia-nccl-cu12`` or ``nvidia-nccl-cu13``."""
    major = cuda_major(runtime_version)
    return f"nvidia-nccl-cu{major}" if major else "nvidia-nccl-cu12 or nvidia-nccl-cu13"


def install_hint(runtime_version: int | None) -> str:
    """What to install for NCCL on GPUs, for this CUDA major version."""
    return f"`pip install {cupy_package(runtime_version)} {nccl_package(runtime_version)}`"


def cuda_runtime_version() -> int | None:
    """The CUDA runtime version CuPy was built for (e.g. 13000); None without CuPy. Needs no
    GPU and creates no context."""
    cupy = cupy_or_none()
    if cupy is None:
        return None
    try:
        return int(cupy.cuda.runtime.runtimeGetVersion())
    except Exception:  # noqa: BLE001 - a broken CUDA install: the version is unknown
        return None


@functools.cache
def cupy_or_none():
    """The cupy module, or None when it is missing or cannot load (no CUDA library)."""
    try:
        return importlib.import_module("cupy")
    except Exception:  # noqa: BLE001 - cupy raises various errors without CUDA
        return None


def cupy_takes_bfloat16(cupy_version: str, numpy_version: str, ml_dtypes: bool) -> bool:
    """Whether this CuPy handles bfloat16 arrays (DLPack import, copies, arithmetic): CuPy 14
    does, through ``ml_dtypes``, and only with NumPy 2.1.2 or newer (it leaves them out on
    older NumPy)."""
    def numbers(version: str) -> tuple[int, ...]:
        parts = []
        for part in version.split(".")[:3]:
            digits = "".join(ch for ch in part if ch.isdigit()) or "0"
            parts.append(int(digits))
        return tuple(parts)

    return ml_dtypes and numbers(cupy_version)[0] >= 14 and numbers(numpy_version) >= (2, 1, 2)


@functools.cache
def bfloat16_on_device() -> bool:
    """:func:`cupy_takes_bfloat16` for the installed CuPy and NumPy."""
    cupy = cupy_or_none()
    if cupy is None:
        return False
    try:
        importlib.import_module("ml_dtypes")
        has_ml_dtypes = True
    except ImportError:
        has_ml_dtypes = False
    return cupy_takes_bfloat16(cupy.__version__, np.__version__, has_ml_dtypes)


# -- one GPU per rank, checked across the ranks ------------------------------------------------
def multi_rank_gpu_allowed(nccl_version: int, env: Mapping[str, str]) -> bool:
    """NCCL accepts several ranks on one GPU only from 2.30, and only with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (older releases fail: "Duplicate GPU detected")."""
    return (bool(nccl_version) and nccl_version_tuple(nccl_version) >= (2, 30, 0)
            and env.get("NCCL_MULTI_RANK_GPU_ENABLE", "").strip() == "1")


def shared_gpus(entries: Sequence[tuple[object, str | None]]) -> list[list[int]]:
    """The groups of ranks that would share one GPU: ``entries[rank]`` is (node, the PCI bus
    id of the rank's GPU, or None for a rank without one)."""
    owners: dict[tuple[object, str], list[int]] = {}
    for rank, (node, bus_id) in enumerate(entries):
        if bus_id is not None:
            owners.setdefault((node, bus_id.lower()), []).append(rank)
    return [ranks for ranks in owners.values() if len(ranks) > 1]


def sharing_message(groups: list[list[int]], entries: Sequence[tuple[object, str | None]]
                    ) -> str:
    """Why NCCL cannot run on this layout, naming the ranks and GPUs concerned and the fixes."""
    shown = "; ".join(f"ranks {', '.join(map(str, ranks))} on GPU {entries[ranks[0]][1]}"
                      for ranks in groups[:4])
    more = f" (and {len(groups) - 4} more)" if len(groups) > 4 else ""
    return (f"several ranks would use one GPU ({shown}{more}), which NCCL refuses "
            "(\"Duplicate GPU detected\"). Start one rank per GPU: `--ntasks-per-node` = GPUs "
            "per node, or `srun --gpus-per-task=1`; a launcher that sets CUDA_VISIBLE_DEVICES "
            "per rank must give each rank of a node a different GPU. NCCL 2.30 or newer "
            "accepts it with NCCL_MULTI_RANK_GPU_ENABLE=1.")


def device_bus_id(device: int) -> str:
    """The PCI bus id of visible device ``device``: the same physical GPU has the same id in
    every process of the node, whatever its ``CUDA_VISIBLE_DEVICES``. Creates no context."""
    import cupy

    return cupy.cuda.runtime.deviceGetPCIBusId(device)


# -- threads and streams ------------------------------------------------------------------------
def pin_thread(device: int) -> None:
    """Make ``device`` the calling thread's current CUDA device, if it is not already.

    Every thread that runs the engine's cycles (the engine thread, and a caller blocked in
    ``Engine.wait``) calls it before device work: a thread starts on device 0, and since CUDA 12
    making a device current creates its context, so a ``with cupy.cuda.Device(n)`` block,
    which restores the previous device on exit, would create a context on GPU 0 in every rank
    (about 0.5 GiB each; an error where GPUs are in EXCLUSIVE_PROCESS mode).
    """
    import cupy

    runtime = cupy.cuda.runtime
    if runtime.getDevice() != device:
        runtime.setDevice(device)


def event_pointer(event) -> int:
    """The ``cudaEvent_t`` of a CuPy event (``ptr``) or a torch event (``cuda_event``)."""
    ptr = getattr(event, "ptr", None)
    return int(ptr if ptr is not None else event.cuda_event)


#: The framework allocator that device results come from (see :func:`use_framework_memory`).
_framework_memory: Callable[[int, int], Callable[[int], object]] | None = None


def use_framework_memory(factory: Callable[[int, int], Callable[[int], object]]) -> None:
    """Allocate the engine's device arrays with a framework's allocator: ``factory(device,
    stream_ptr)`` returns a CuPy allocator (size in bytes -> ``cupy.cuda.MemoryPointer``) for
    work on that stream. CuPy's own pool is stream-aware: a block it handed to a framework
    would go back to the engine's stream as soon as the framework dropped the tensor, possibly
    while the framework's stream still reads it. The torch binding registers torch's caching
    allocator, whose ``record_stream`` covers that case."""
    global _framework_memory
    _framework_memory = factory


class DeviceStream:
    """The engine's work on one GPU: a non-blocking stream of its own, created on first use by
    the thread that runs it (on the right device), the producers' ready events it waits for,
    the done events the consumers wait for, and the framework's allocator while it runs.
    One per device and process (:func:`device_stream`), shared by every process set."""

    def __init__(self, device: int):
        self.device = int(device)
        self._stream = None
        self._allocator = None

    @property
    def stream(self):
        if self._stream is None:
            import cupy

            pin_thread(self.device)
            self._stream = cupy.cuda.Stream(non_blocking=True)
        return self._stream

    @contextlib.contextmanager
    def activate(self):
        """This device and stream current in this thread: cupy kernels and allocations inside
        are ordered with the collectives, in the framework's memory when it registered one."""
        import cupy

        pin_thread(self.device)
        stream = self.stream
        if self._allocator is None and _framework_memory is not None:
            self._allocator = _framework_memory(self.device, stream.ptr)
        with stream:
            if self._allocator is None:
                yield
            else:
                with cupy.cuda.using_allocator(self._allocator):
                    yield

    def wait_for(self, event) -> None:
        """Order this stream after ``event`` (recorded on a producer's stream)."""
        import cupy

        cupy.cuda.runtime.streamWaitEvent(self.stream.ptr, event_pointer(event), 0)

    def done_event(self):
        """An event at the current end of this stream, for consumers to wait on."""
        import cupy

        pin_thread(self.device)
        event = cupy.cuda.Event(disable_timing=True)
        event.record(self.stream)
        return event


_DEVICE_STREAMS: dict[int, DeviceStream] = {}


def device_stream(device: int) -> DeviceStream:
    """This process's :class:`DeviceStream` for ``device``."""
    ds = _DEVICE_STREAMS.get(device)
    if ds is None:
        ds = _DEVICE_STREAMS[device] = DeviceStream(device)
    return ds


def array_device(array) -> int | None:
    """The CUDA device of a cupy array, None for a host array."""
    if isinstance(array, np.ndarray):
        return None
    return int(array.device.id)


def group_device(backend, arrays) -> int:
    """The device a group of device arrays runs on: the backend's (NCCL: the rank's GPU), else
    the arrays' own (one process)."""
    if backend.device is not None:
        return int(backend.device)
    for array in arrays:
        if array is not None:
            return array_device(array)
    raise ValueError("a device group without a device array")


def check_tensor_device(index: int, rank_device: int, op_name: str) -> None:
    """Raise ValueError when a CUDA tensor is on another GPU than this rank's: the collective
    runs on the rank's GPU, and reading another device's memory there would race with that
    device's streams."""
    if index != rank_device:
        raise ValueError(
            f"{op_name}: the tensor is on cuda:{index} but this rank's GPU is "
            f"cuda:{rank_device} (one process: the GPU of its first CUDA tensor). Move it "
            f"there (tensor.to('cuda:{rank_device}')), or use that GPU for all of the rank's "
            "tensors: `torch.cuda.set_device(hvd.local_rank())` (or hvd.pin_gpu()) at the "
            "start, and tensors on 'cuda'.")


def nccl_built() -> int:
    """The NCCL version as an integer (e.g. 22703), 0 when cupy's NCCL is not available."""
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001 - cupy raises various errors without a driver
        return 0
    if not getattr(nccl, "available", False):
        return 0
    try:
        return int(nccl.get_version())
    except Exception:  # noqa: BLE001
        return 0


def cuda_built() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True
