"""``SyncBatchNormalization``: Keras 3 batch normalization whose training statistics are those of
the global batch, every rank's samples together (Horovod's ``hvd.SyncBatchNormalization``)::

    model = keras.Sequential([..., hvd.SyncBatchNormalization(), ...])

For small per-rank batches (detection, segmentation) the statistics of one rank's few samples
are too noisy; here each training step allreduces, in one call, the per-channel sums of the
values and of their squares and the sample counts, so the mean and variance are exact over the
global batch even when ranks hold batches of different sizes. Inference uses the moving
statistics as usual. Saved models load it back wherever ``hpc_horovod.tensorflow`` is imported
(it is registered with Keras as ``hpc_horovod>SyncBatchNormalization``).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from ..common.basics import ProcessSet, global_process_set
from ..common.types import Sum
from .mpi_ops import _allreduce


@keras.saving.register_keras_serializable(package="hpc_horovod")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with statistics over every rank of ``process_set``."""

    def __init__(self, process_set: ProcessSet = global_process_set, fused=False, **kwargs):
        """``fused``: Horovod's argument, which Keras 3 no longer takes: False (the only value
        Horovod accepts) is dropped; True or None raise ValueError."""
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True")
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization synchronizes through hpc_horovod; "
                             "synchronized=True (tf.distribute) does not apply")
        super().__init__(**kwargs)
        self.process_set = process_set

    @tf.autograph.experimental.do_not_convert
    def _moments(self, inputs, mask):
        if self.process_set.size() == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        weights = tf.ones_like(inputs) if mask is None else tf.broadcast_to(
            tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs))
        local = tf.stack([tf.reduce_sum(inputs * weights, axes),
                          tf.reduce_sum(tf.square(inputs) * weights, axes),
                          tf.reduce_sum(weights, axes)])
        total, total_squares, count = tf.unstack(
            _allreduce(local, op=Sum, process_set=self.process_set))
        mean = total / count
        # E[x^2] - E[x]^2 can come out a rounding error below zero.
        variance = tf.maximum(total_squares / count - tf.square(mean), 0.0)
        return mean, variance
