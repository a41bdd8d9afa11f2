"""What this installation can do on GPUs, and what to install when it cannot.

Versions (CuPy, its CUDA runtime, NCCL), whether CuPy handles bfloat16, whether CuPy can compile
and run a kernel here (:func:`kernels_work`), the transport for device buffers
(:func:`choose_device_backend`: NCCL, or host memory over MPI) and the pip packages that fix
what is missing for the CUDA major version at hand. Nothing here needs a GPU except
:func:`kernels_work`.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import numpy as np

#: NCCL 2.7 brought ncclSend/ncclRecv, which alltoall needs.
NCCL_MIN_VERSION = (2, 7, 0)
NCCL = "nccl"
MPI_STAGED = "mpi-staged"


def nccl_version_tuple(code: int) -> tuple[int, int, int]:
    """(major, minor, patch) of an NCCL version code (2.9+ encodes 2.19.3 as 21903; older
    releases encoded 2.7.8 as 2708)."""
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def select_device_backend(cupy_available: bool, nccl_version: int) -> str:
    """How device buffers move: ``"nccl"``, or ``"mpi-staged"`` (through host memory)."""
    if cupy_available and nccl_version and nccl_version_tuple(nccl_version) >= NCCL_MIN_VERSION:
        return NCCL
    return MPI_STAGED


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
    return (f"GPU tensors will not use NCCL because {why}; they move through host memory over "
            "MPI (slower: each buffer is copied to the host and back).")


def choose_device_backend() -> tuple[str, str | None]:
    """This installation's transport for device buffers and the warning to show once at init
    (None when NCCL is used)."""
    cupy_available, version = cuda_built(), nccl_built()
    choice = select_device_backend(cupy_available, version)
    return choice, fallback_warning(choice, cupy_available, version)


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


def toolkit_hint(runtime_version: int | None) -> str:
    """What to install when CuPy loads but cannot compile a kernel: NVRTC and the CUDA headers
    (``cuda_fp16.h``) that CuPy's kernels include, for this CUDA major version."""
    major = cuda_major(runtime_version)
    package = f"cupy-cuda{major}x[ctk]" if major else "cupy-cuda12x[ctk] or cupy-cuda13x[ctk]"
    nvrtc = f"nvidia-cuda-nvrtc-cu{major}" if major else "nvidia-cuda-nvrtc-cu12/-cu13"
    return (f"`pip install '{package}'` (NVRTC and the CUDA headers; or {nvrtc} with the "
            "CUDA runtime headers), or load the cluster's CUDA toolkit module")


def kernel_failure(exc: BaseException | None, runtime_version: int | None) -> str | None:
    """The warning for a failed kernel probe (None when it passed): what failed and what to
    install."""
    if exc is None:
        return None
    what = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    return (f"CuPy loads but cannot compile and run a kernel on this GPU ({what}), so GPU "
            f"tensors go through host memory. Install {toolkit_hint(runtime_version)}.")


#: the kernel probe's answer, once per process: the failure text, or None when kernels work
_KERNEL_PROBE: dict[str, str | None] = {}


def kernel_problem(device: int) -> str | None:
    """Why CuPy cannot compile and run kernels here (:func:`kernel_failure`'s text), or None
    when it can: one float16 elementwise kernel (NVRTC and ``cuda_fp16.h``, which every pack,
    scale and widening kernel of the engine needs), run once per process on ``device``, which
    gets a context (the rank's own GPU, or the GPU of the caller's tensor). Without CuPy the
    answer is a short text too: no kernels run without it."""
    cupy = cupy_or_none()
    if cupy is None:
        return f"CuPy is not installed ({install_hint(None)})"
    if "text" not in _KERNEL_PROBE:
        from .gpu_stream import on_device

        error: BaseException | None = None
        # A pool of its own, emptied after: CuPy's default pool stays unused (the engine's
        # device memory comes from the framework, see gpu_stream.use_framework_memory).
        pool = cupy.cuda.MemoryPool()
        try:
            with on_device(device), cupy.cuda.using_allocator(pool.malloc):
                halves = cupy.full(4, 3, dtype=cupy.float16)
                scaled = cupy.multiply(halves, cupy.float32(0.5), dtype=cupy.float32)
                if float(scaled.sum()) != 6.0:
                    raise RuntimeError(f"a test kernel computed {scaled.get()!r}")
                del halves, scaled
        except Exception as exc:  # noqa: BLE001 - any failure means: no device kernels here
            error = exc
        pool.free_all_blocks()
        _KERNEL_PROBE["text"] = kernel_failure(error, cuda_runtime_version())
    return _KERNEL_PROBE["text"]


def kernels_work(device: int) -> bool:
    """Whether CuPy compiles and runs kernels here (:func:`kernel_problem`), for one process.
    When it cannot, one warning says why and what to install, and the caller stages GPU
    tensors through host memory. Without CuPy: False, without a word (as documented)."""
    if cupy_or_none() is None:
        return False
    first = "text" not in _KERNEL_PROBE
    text = kernel_problem(device)
    if first and text is not None:
        warnings.warn(text, RuntimeWarning, stacklevel=2)
    return text is None
