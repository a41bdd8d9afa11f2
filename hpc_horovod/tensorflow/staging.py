"""Where tensor bytes meet the engine: host memory.

The engine reduces host (numpy) buffers today. A CPU tensor's numpy view shares its memory; a GPU
tensor is copied to the host and the result copied back to the tensor's device. These two
functions are the only place that does it, so that a device-side backend (NCCL on the GPU stream)
replaces them without touching the ops. Inside ``tf.function`` the graph op (``tf.numpy_function``)
runs on the CPU and TensorFlow inserts the same copies itself.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


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
