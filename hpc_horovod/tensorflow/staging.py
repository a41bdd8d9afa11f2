"""Where tensor bytes meet the engine: host memory.

A CPU tensor's numpy view shares its memory; a GPU tensor is copied to the host and the result
copied back to the tensor's device. These functions are the only place that does it. Inside
``tf.function`` the graph op (``tf.numpy_function``) runs on the CPU and TensorFlow inserts the
same copies itself.

TensorFlow GPU tensors stay on this path, not NCCL, because TensorFlow gives no way to order
another stream's work with its own GPU stream, which a zero-copy handover needs on both sides:

- inputs: ``tf.Tensor.__dlpack__`` refuses a consumer's stream ("tf.Tensor does not support
  DLPack export with a non-None stream", ``tensorflow/python/framework/ops.py``, TF 2.21), and
  ``tf.experimental.dlpack.to_dlpack`` hands out the device pointer with no event or stream
  (``TFE_HandleToDLPack``, ``tensorflow/c/eager/dlpack.cc``): the kernel that writes the tensor
  may still be queued on TensorFlow's stream. Only ``tf.test.experimental.sync_devices``, a
  benchmarking aid that waits for every device, would order it;
- results: ``tf.experimental.dlpack.from_dlpack`` wraps the memory with a deleter that runs
  when the host lets go of the tensor, not when TensorFlow's stream is done with it, so the
  engine's allocator could hand the block out again while TensorFlow still reads it.

:func:`note_gpu_staging` says so once, on rank 0, with what it costs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import tensorflow as tf

#: set once :func:`note_gpu_staging` has looked
_NOTED: list[bool] = []


def to_host(tensor: tf.Tensor) -> np.ndarray:
    """A host array with the tensor's values (a view for CPU tensors, a copy for GPU ones)."""
    return tensor.numpy()


def to_device(array: np.ndarray, dtype: tf.DType, device: str) -> tf.Tensor:
    """A tensor of ``dtype`` with the values of ``array``, placed on ``device`` (the input's)."""
    tensor = tf.convert_to_tensor(array, dtype=dtype)
    if device and tf.DeviceSpec.from_string(device).device_type == "GPU":
        with tf.device(device):
            return tf.identity(tensor)
    return tensor


def staging_cost(nbytes: int) -> str:
    """The once-said note on TensorFlow GPU tensors: what happens to them and what it costs,
    for a first collective of ``nbytes``."""
    return (f"TensorFlow GPU tensors go through host memory over MPI, not NCCL: each "
            f"collective waits for TensorFlow's GPU stream, copies its tensors to the host and "
            f"the results back ({nbytes} bytes each way for the first one), and crosses nodes "
            "over MPI. TensorFlow offers no way to order another stream with its own "
            "(tf.Tensor.__dlpack__ refuses a stream); see docs/gpu.md. PyTorch tensors use "
            "NCCL on the device.")


def note_gpu_staging(tensors, rank: Callable[[], int]) -> None:
    """Once per process, at the first collective: on rank 0 (``rank()``), where TensorFlow
    sees a GPU, warn with :func:`staging_cost` (the collective's bytes)."""
    if _NOTED:
        return
    _NOTED.append(True)
    if not tf.config.list_logical_devices("GPU") or rank() != 0:
        return
    nbytes = sum(int(np.prod(t.shape.as_list() or [1])) * t.dtype.size for t in tensors
                 if t.shape.is_fully_defined())
    warnings.warn(staging_cost(nbytes), RuntimeWarning, stacklevel=3)
