"""Torch tensors <-> the engine's numpy arrays, without copies where memory allows.

A contiguous CPU tensor and its numpy view share memory, so the engine reads inputs and writes
in-place results straight into the tensor. bfloat16 has no numpy dtype of its own: the bits are
viewed as int16 in torch and as ``ml_dtypes.bfloat16`` in numpy. CUDA tensors go to the engine
as cupy views (DLPack, zero copy) when it moves GPU memory itself (NCCL, or one process), and are
staged through host memory by :func:`to_host` otherwise (and for bfloat16, which CuPy lacks).
"""

from __future__ import annotations

import numpy as np
import torch

from ..common import basics
from ..common.types import bfloat16

#: torch dtypes the engine reduces, gathers and broadcasts
SUPPORTED_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
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
    check_tensor(tensor, op_name)
    if tensor.is_cpu and tensor.is_contiguous():  # the common case, kept short
        host = tensor.detach() if tensor.requires_grad else tensor
    else:
        if inplace and not tensor.is_contiguous():
            raise ValueError(f"Tensor is required to be contiguous for the in-place {op_name}: "
                             f"call it on tensor.contiguous() and copy back, or use the "
                             f"out-of-place {op_name.rstrip('_')}")
        if tensor.is_cuda and tensor.dtype != torch.bfloat16 and \
                basics.device_transport() != "host":
            import cupy

            return cupy.from_dlpack(tensor.detach().contiguous())
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
        return torch.from_dlpack(array)
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
                target.copy_(torch.from_dlpack(array).view(target.shape))
        return target
    if target.is_cpu and array.ctypes.data == target.data_ptr():
        return target
    with torch.no_grad():
        target.copy_(to_torch(array).view(target.shape))
    return target
