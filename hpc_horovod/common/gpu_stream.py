"""The engine's device work: which GPU a thread works on, one stream per GPU, the events that
order it with the framework's streams, and the framework's allocator for its arrays.

A thread's current CUDA device is changed only where device work runs (:func:`pin_thread`),
and a caller's thread gets its own device back afterwards (:func:`on_device`). Since CUDA 12
making a device current creates its context (about 0.5 GiB, and an error where GPUs are in
EXCLUSIVE_PROCESS mode), so no device is made current that has no context yet, except the one
the work runs on.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
from collections.abc import Callable

import numpy as np


class CudaDevices:
    """The calling thread's current device through the CUDA runtime (CuPy's binding), and
    whether a device's primary context exists yet (the driver's ``cuDevicePrimaryCtxGetState``,
    which creates nothing). The engine's one instance is :data:`CUDA`; tests pass a stand-in
    with the same three methods."""

    def __init__(self):
        self._driver = None

    def get(self) -> int:
        import cupy

        return int(cupy.cuda.runtime.getDevice())

    def set(self, device: int) -> None:
        import cupy

        cupy.cuda.runtime.setDevice(device)

    def has_context(self, device: int) -> bool:
        if self._driver is None:
            self._driver = ctypes.CDLL("libcuda.so.1")  # loaded already by the CUDA runtime
        handle, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if self._driver.cuDeviceGet(ctypes.byref(handle), int(device)) != 0:
            return False
        status = self._driver.cuDevicePrimaryCtxGetState(handle, ctypes.byref(flags),
                                                         ctypes.byref(active))
        return status == 0 and bool(active.value)


CUDA = CudaDevices()


def pin_thread(device: int, devices: CudaDevices = CUDA) -> None:
    """Make ``device`` the calling thread's current CUDA device, if it is not already.

    Device work calls it first: a thread starts on device 0, and a ``with
    cupy.cuda.Device(n)`` block, which restores the previous device on exit, would create a
    context on GPU 0 in every rank. A caller's thread gets its device back from
    :func:`on_device`.
    """
    if devices.get() != device:
        devices.set(device)


@contextlib.contextmanager
def on_device(device: int, devices: CudaDevices = CUDA):
    """``device`` current in this thread inside the block; afterwards the thread's previous
    device again, so that a synchronous op leaves the caller's current device as it found it.
    The previous device is made current again only where it has a context (as torch's own
    device guard does): making a device current creates its context, which the caller never
    asked for (a thread that never chose a device is on device 0)."""
    previous = devices.get()
    pin_thread(device, devices)
    try:
        yield
    finally:
        if previous != device and devices.get() != previous and devices.has_context(previous):
            devices.set(previous)


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


def array_module(array):
    """numpy for host arrays, cupy for device arrays: the module that allocates alongside."""
    if isinstance(array, np.ndarray):
        return np
    return importlib.import_module("cupy")


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
