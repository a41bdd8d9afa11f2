"""hpc_horovod for Keras 3 on the TensorFlow backend (Horovod's ``horovod.tensorflow.keras``,
also importable as ``hpc_horovod.keras``)::

    import keras
    import hpc_horovod.tensorflow.keras as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    model.fit(x, y, steps_per_epoch=steps // hvd.size(), verbose=1 if hvd.rank() == 0 else 0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()])

``allreduce``/``allgather``/``broadcast``/``reducescatter`` here take values (numbers, numpy
arrays, tensors, a metric's ``result()``) and return ``tf.Tensor``s, as Horovod's Keras API does
in eager mode: ``hvd.allreduce(val_loss.result()).numpy()``.
"""

from __future__ import annotations

import tensorflow as tf

from .. import (  # noqa: F401 - re-exported API
    Adasum,
    Average,
    Compression,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    SyncBatchNormalization,
    add_process_set,
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_variables,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_ops,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    shutdown,
    size,
    weighted_average,
)
from . import callbacks, elastic
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """The reduction of ``value`` over the ranks (default op: Average)."""
    return mpi_ops.allreduce(tf.convert_to_tensor(value), average=average,
                             compression=compression, op=op, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, name=name,
                             process_set=process_set)


def allgather(value, name=None, process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's ``value`` concatenated along the first dimension."""
    return mpi_ops.allgather(tf.convert_to_tensor(value), name=name, process_set=process_set)


def broadcast(value, root_rank: int, name=None,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``value`` on every rank."""
    return mpi_ops.broadcast(tf.convert_to_tensor(value), root_rank, name=name,
                             process_set=process_set)


def reducescatter(value, name=None, op=Average,
                  process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """This rank's block of rows of the reduction of ``value`` over the ranks."""
    return mpi_ops.reducescatter(tf.convert_to_tensor(value), op=op, name=name,
                                 process_set=process_set)


__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max",
    "Min", "PartialDistributedOptimizer", "ProcessSet", "Product", "Sum",
    "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object",
    "allreduce", "broadcast", "broadcast_global_variables", "broadcast_object",
    "broadcast_variables", "callbacks", "cross_rank", "cross_size", "elastic",
    "global_process_set", "init",
    "is_homogeneous", "is_initialized", "load_model", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "reducescatter",
    "remove_process_set", "shutdown", "size", "weighted_average",
]
