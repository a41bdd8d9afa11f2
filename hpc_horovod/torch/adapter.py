"""Torch tensors <-> the engine's arrays, without copies where memory allows.

A contiguous CPU tensor and its numpy view share memory, so the engine reads inputs and writes
in-place results straight into the tensor. bfloat16 has no numpy dtype of its own: the bits are
viewed as int16 in torch and as ``ml_dtypes.bfloat16`` in numpy.

CUDA tensors go to the engine as cupy views (DLPack, zero copy) when it moves GPU memory itself
(:func:`device_views`): under NCCL, and in one process when CuPy runs kernels; bfloat16 only
where CuPy handles it (CuPy 14 with ``ml_dtypes``). Otherwise they are staged through host
memory (:func:`to_host`), which needs nothing beyond torch. On the device, three things keep the
engine's stream and torch's streams apart: the event recorded on the tensor's device's current
stream when a request is submitted (:func:`ready_event`), the engine's done event that stream
waits for before it reads a result (:func:`take_device_result`), and result memory allocated by
torch's caching allocator on the engine's stream (:func:`torch_memory`), marked as used by the
consumer's stream so that torch does not hand it out again before that stream is done with it.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from ..common import basics, gpu_layout, gpu_probe, gpu_stream
from ..common.types import bfloat16

#: torch dtypes the engine reduces, gathers and broadcasts
SUPPORTED_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
#: the dtypes whose CPU tensors ``Tensor.numpy()`` views
_NUMPY_VIEWED = _SUPPORTED - {torch.bfloat16}
#: the numpy dtype of each supported torch dtype's engine view (bfloat16: ml_dtypes')
NUMPY_DTYPES = {t: bfloat16 if t == torch.bfloat16 else np.dtype(str(t).removeprefix("torch."))
                for t in SUPPORTED_DTYPES}


def check_tensor(tensor, op_name: str) -> None:
    """Raise TypeError for a non-tensor and ValueError for a dtype the engine cannot handle."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op_name} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _SUPPORTED:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise ValueError(f"Tensor type {tensor.dtype} is not supported by {op_name}; supported: "
                         f"{names}. Convert it first, e.g. tensor.to(torch.float32).")
    if tensor.is_sparse:
        raise ValueError(f"{op_name} needs a dense tensor; for sparse gradients use "
                         "sparse_allreduce_async (or tensor.to_dense())")


def device_views(transport: str, dtype: torch.dtype, device: int) -> bool:
    """Whether CUDA tensors of ``dtype`` on GPU ``device`` go to the engine as cupy views (else
    through host memory): the engine moves device memory itself under NCCL, and in one process
    when CuPy compiles and runs kernels there (``gpu_probe.kernels_work``, which says what to
    install when not); bfloat16 needs a CuPy that handles it (``gpu_probe.bfloat16_on_device``).
    """
    if transport == "nccl":
        usable = True
    elif transport == "single":
        usable = gpu_probe.kernels_work(device)
    else:
        return False
    return usable and (dtype != torch.bfloat16 or gpu_probe.bfloat16_on_device())


#: (engine, device) of one process: its GPU is the one of its first CUDA tensor
_single_gpu: list = [None, None]


def rank_device(index: int) -> int | None:
    """This rank's GPU, for a CUDA tensor on GPU ``index``: the NCCL backend's under NCCL; in
    one process the GPU of its first CUDA tensor since ``init`` (the engine runs one GPU's
    tensors per group); None when GPU tensors go through host memory."""
    transport = basics.device_transport()
    if transport == "nccl":
        return basics.engine().backend.device
    if transport == "single":
        engine = basics.engine()
        if _single_gpu[0] is None or _single_gpu[0]() is not engine:
            _single_gpu[:] = [weakref.ref(engine), index]
        return _single_gpu[1]
    return None


def ready_event(arrays) -> torch.cuda.Event:
    """An event recorded on torch's current stream of the arrays' device, where the kernels
    that produced them were queued (not the current device's stream: a script may use
    ``cuda:k`` tensors without ``set_device``). The engine's stream waits for it."""
    device = gpu_stream.array_device(arrays[0])
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def from_device(array) -> torch.Tensor:
    """The tensor over a cupy array's memory (DLPack, zero copy). The exchange records and
    waits for events on the current device's streams, on both sides: done with the array's
    device current (torch's guard, which restores the previous device without creating its
    context), it touches no other GPU."""
    with torch.cuda.device(gpu_stream.array_device(array)):
        return torch.from_dlpack(array)


def take_device_result(req) -> None:
    """Before torch reads a device result: its device's current stream waits for the engine's
    done event, and the result's memory (torch's, see :func:`torch_memory`) is marked as used
    by that stream, so that torch reuses it only once the stream is past its last use."""
    device = gpu_stream.array_device(req.tensor)
    stream = torch.cuda.current_stream(device)
    with torch.cuda.device(device):
        gpu_probe.cupy_or_none().cuda.runtime.streamWaitEvent(stream.cuda_stream,
                                                        gpu_stream.event_pointer(req.done_event), 0)
    results = req.result if isinstance(req.result, tuple) else (req.result,)
    for result in results:
        owner = getattr(getattr(getattr(result, "data", None), "mem", None), "_owner", None)
        if isinstance(owner, torch.Tensor):
            owner.record_stream(stream)


def torch_memory(device: int, stream_ptr: int):
    """A CuPy allocator over torch's caching allocator, for the engine's device work on the
    stream ``stream_ptr`` (registered with ``gpu_stream.use_framework_memory``): blocks belong
    to that stream, so temporaries are reused in its order, and results handed to torch are
    torch's memory (see :func:`take_device_result`)."""
    cupy = gpu_probe.cupy_or_none()
    where = torch.device("cuda", device)
    stream = torch.cuda.ExternalStream(stream_ptr, device=where)

    def allocate(nbytes: int):
        with torch.cuda.stream(stream):
            owner = torch.empty(nbytes, dtype=torch.uint8, device=where)
        memory = cupy.cuda.UnownedMemory(owner.data_ptr(), nbytes, owner, device)
        return cupy.cuda.MemoryPointer(memory, 0)

    return allocate


gpu_stream.use_framework_memory(torch_memory)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The CPU tensor the engine works on: ``tensor`` itself on the host, a host copy of a CUDA
    tensor (staged until a GPU backend reduces device memory directly)."""
    if tensor.is_cpu:
        return tensor.detach() if tensor.requires_grad else tensor
    return tensor.detach().to("cpu")


def engine_array(tensor: torch.Tensor, op_name: str, inplace: bool = False) -> np.ndarray:
    """A numpy array over ``tensor``'s memory (or over a contiguous host copy of it).

    ``inplace``: the engine will write the result into the array, so the tensor must be
    contiguous (a copy would silently drop the result). A contiguous CPU tensor always gets
    a view of its own memory, which :func:`write_back` relies on.
    """
    # The common case (every gradient bucket), kept short: what check_tensor would accept.
    if type(tensor) is torch.Tensor and tensor.dtype in _NUMPY_VIEWED and not tensor.is_sparse \
            and tensor.is_cpu and tensor.is_contiguous() and not tensor.requires_grad:
        return tensor.numpy()
    check_tensor(tensor, op_name)
    if tensor.is_cpu and tensor.is_contiguous():
        host = tensor.detach() if tensor.requires_grad else tensor
    else:
        if inplace and not tensor.is_contiguous():
            raise ValueError(f"Tensor is required to be contiguous for the in-place {op_name}: "
                             f"call it on tensor.contiguous() and copy back, or use the "
                             f"out-of-place {op_name.rstrip('_')}")
        if tensor.is_cuda and device_views(basics.device_transport(), tensor.dtype,
                                              tensor.get_device()):
            index = tensor.get_device()
            device = rank_device(index)
            if device is not None:
                gpu_layout.check_tensor_device(index, device, op_name)
            with torch.cuda.device(index):  # see from_device
                return gpu_probe.cupy_or_none().from_dlpack(tensor.detach().contiguous())
        host = to_host(tensor)
        if not host.is_contiguous():
            host = host.contiguous()
    if host.dtype == torch.bfloat16:
        return np.asarray(_Bfloat16Bits(host)).view(bfloat16)
    return host.numpy()


class _Bfloat16Bits:
    """A contiguous bfloat16 tensor's memory as numpy int16, for ``np.asarray`` (the array
    keeps this object, hence the tensor, alive). ``tensor.view(torch.int16).numpy()`` would do
    the same but lets go of the GIL, which let the engine thread in between two submissions of
    one step, with a cycle for each part of the batch (11-15 cycles for 200 tensors in one
    process, instead of one)."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.__array_interface__ = {"data": (tensor.data_ptr(), False), "typestr": "<i2",
                                    "shape": tuple(tensor.shape), "version": 3}


def to_torch(array: np.ndarray, device: torch.device | None = None) -> torch.Tensor:
    """A tensor on ``device`` (None: the CPU) holding ``array`` (zero copy on the CPU and for
    GPU arrays)."""
    if not isinstance(array, np.ndarray):
        return from_device(array)
    if array.dtype == bfloat16:
        tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array)
    return tensor if device is None or device.type == "cpu" else tensor.to(device)


def write_back(array: np.ndarray, target: torch.Tensor,
               view: np.ndarray | None = None) -> torch.Tensor:
    """Make ``target`` hold the in-place result ``array``; a no-op when the engine already wrote
    into ``target``'s own memory: ``array`` is ``view``, the array :func:`engine_array` gave it
    (checked first: it is free), or it starts at the tensor's address."""
    if array is view and target.is_cpu:  # engine_array's view of a CPU tensor's memory
        return target
    if not isinstance(array, np.ndarray):
        if array.data.ptr != target.data_ptr():
            with torch.no_grad():
                target.copy_(from_device(array).view(target.shape))
        return target
    if target.is_cpu and array.ctypes.data == target.data_ptr():
        return target
    with torch.no_grad():
        target.copy_(to_torch(array).view(target.shape))
    return target
