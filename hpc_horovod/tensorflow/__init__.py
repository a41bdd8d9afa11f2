"""hpc_horovod for TensorFlow 2 (eager and ``tf.function``) and TF1-style ``tf.compat.v1`` graphs,
with Horovod's names and defaults::

    import tensorflow as tf
    import hpc_horovod.tensorflow as hvd

    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:  # one GPU per process
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    # after the first step (once the optimizer has its variables):
    hvd.broadcast_variables(model.variables + opt.variables, root_rank=0)

GPU tensors go through host memory for now (``staging``). Keras 3: ``hpc_horovod.tensorflow.keras``.
"""

from __future__ import annotations

import tensorflow as tf
from keras.optimizers import Optimizer as KerasOptimizer

from ..common.basics import (
    ProcessSet,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    pin_gpu,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from ..common.errors import HorovodInternalError, HostsUpdatedInterrupt
from ..common.gpu_layout import GpuLayoutError
from ..common.types import Adasum, Average, Max, Min, Product, Sum
from . import elastic, util  # noqa: F401 - horovod.tensorflow.util (hvd.util._executing_eagerly)
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_variables, weighted_average
from .legacy import (
    BroadcastGlobalVariablesHook,
    broadcast_global_variables,
    distributed_legacy_optimizer,
)
from .mpi_ops import (
    CollectiveError,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    cross_rank_op,
    cross_size_op,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)
from .sync_batch_norm import SyncBatchNormalization
from .tape import DistributedGradientTape, PartialDistributedGradientTape
from .util import _executing_eagerly  # noqa: F401 - Horovod exports it here too


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set: ProcessSet = global_process_set):
    """Wrap an optimizer so that it averages (``op``) gradients over the ranks before applying
    them: a ``tf.compat.v1.train.Optimizer`` (TF1 graphs: ``compute_gradients`` is reduced) or a
    Keras optimizer (see ``hpc_horovod.tensorflow.keras.DistributedOptimizer``)."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step > 1 is supported with Keras optimizers; "
                             "with a tf.compat.v1.train optimizer accumulate gradients yourself")
        return distributed_legacy_optimizer(
            optimizer, name=name, use_locking=use_locking, device_dense=device_dense,
            device_sparse=device_sparse, compression=compression,
            sparse_as_dense=sparse_as_dense, op=op,
            gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
            groups=groups, process_set=process_set)
    if isinstance(optimizer, KerasOptimizer):
        from .keras.optimizer import DistributedOptimizer as keras_distributed_optimizer

        return keras_distributed_optimizer(
            optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
            compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
            groups=groups, process_set=process_set)
    raise ValueError("Provided optimizer doesn't inherit from either legacy TensorFlow or Keras "
                     f"optimizer: {optimizer}")


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set: ProcessSet = global_process_set,
                                local_layers=None, scale_local_gradients=True):
    """A Keras ``DistributedOptimizer`` that leaves the trainable variables of ``local_layers``
    (a Keras layer or a list of them) out of the reduction: each rank applies its own gradient
    to them, divided by the set size when ``scale_local_gradients`` (as in Horovod). See
    ``hpc_horovod.tensorflow.keras.PartialDistributedOptimizer``."""
    from .keras.optimizer import PartialDistributedOptimizer as keras_partial

    return keras_partial(optimizer, name=name, device_dense=device_dense,
                         device_sparse=device_sparse, compression=compression,
                         sparse_as_dense=sparse_as_dense,
                         gradient_predivide_factor=gradient_predivide_factor, op=op,
                         backward_passes_per_step=backward_passes_per_step,
                         average_aggregated_gradients=average_aggregated_gradients,
                         groups=groups, process_set=process_set, local_layers=local_layers,
                         scale_local_gradients=scale_local_gradients)


__all__ = [
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "CollectiveError", "Compression",
    "DistributedGradientTape", "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "elastic",
    "PartialDistributedGradientTape", "PartialDistributedOptimizer", "ProcessSet", "Product",
    "Sum", "SyncBatchNormalization", "add_process_set", "allgather", "allgather_object",
    "allreduce", "alltoall", "barrier", "broadcast", "broadcast_",
    "broadcast_global_variables", "broadcast_object", "broadcast_variables", "ccl_built",
    "cross_rank", "cross_rank_op", "cross_size", "cross_size_op", "cuda_built", "ddl_built",
    "gloo_built", "gloo_enabled", "global_process_set", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_rank_op",
    "local_size", "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "process_set_included_op", "rank", "rank_op", "reducescatter",
    "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "start_timeline",
    "stop_timeline", "weighted_average",
]
