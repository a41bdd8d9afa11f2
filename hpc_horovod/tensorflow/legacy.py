"""TF1-style training through ``tf.compat.v1`` graphs and sessions, unchanged but for the import::

    hvd.init()
    config = tf.compat.v1.ConfigProto()
    config.gpu_options.visible_device_list = str(hvd.local_rank())
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(0.01 * hvd.size()))
    train_op = opt.minimize(loss, global_step=global_step)
    hooks = [hvd.BroadcastGlobalVariablesHook(0), tf.compat.v1.train.StopAtStepHook(100)]
    checkpoint_dir = "/tmp/train_logs" if hvd.rank() == 0 else None
    with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir,
                                                     config=config, hooks=hooks) as sess:
        while not sess.should_stop():
            sess.run(train_op)

Each collective holds an inter-op thread while it waits for the other ranks. Inside
``tf.function`` TensorFlow runs them one after the other in program order; in a tf.compat.v1
graph, independent collectives fetched by one ``Session.run`` may start in a different order on
different ranks, which needs as many inter-op threads as there are such collectives (the default
is one per core). The wrappers here issue one grouped op per step, which is always safe.
"""

from __future__ import annotations

import tensorflow as tf

from ..common.basics import ProcessSet, global_process_set
from ..common.types import Average
from .compression import Compression
from .functions import broadcast_variables
from .gradients import GradientReducer


def broadcast_global_variables(root_rank: int):
    """The op assigning every global variable of the default graph its value on ``root_rank``
    (one grouped broadcast). Graph mode only: in TF2 use ``broadcast_variables``."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts the global variables from ``root_rank`` once the session exists (after
    initialization or a restore from a checkpoint), so every rank starts from the same state."""

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None

    def begin(self):
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a tf.compat.v1.train optimizer: ``compute_gradients`` returns gradients averaged
    over the ranks (one grouped allreduce per step); everything else is the wrapped optimizer's."""

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, reducer: GradientReducer,
                 name: str, use_locking: bool = False):
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = reducer

    def compute_gradients(self, *args, **kwargs):
        grads_and_vars = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = zip(*grads_and_vars)
        return list(zip(self._reducer(grads, variables), variables))

    def apply_gradients(self, *args, **kwargs):
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def distributed_legacy_optimizer(optimizer: tf.compat.v1.train.Optimizer, name=None,
                                 use_locking=False, device_dense="", device_sparse="",
                                 compression=Compression.none, sparse_as_dense=False,
                                 op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                 groups=None, process_set: ProcessSet = global_process_set):
    """``hvd.DistributedOptimizer`` for a tf.compat.v1.train optimizer."""
    name = name or f"Distributed{type(optimizer).__name__}"
    reducer = GradientReducer(name, device_dense=device_dense, device_sparse=device_sparse,
                              compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                              gradient_predivide_factor=gradient_predivide_factor,
                              num_groups=num_groups, groups=groups, process_set=process_set)
    return _DistributedOptimizer(optimizer, reducer, name, use_locking)
