"""``DistributedGradientTape``: a tf.GradientTape whose ``gradient()`` returns gradients already
combined across ranks (TF2 custom training loops)::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x, training=True), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
"""

from __future__ import annotations

import tensorflow as tf

from ..common.basics import ProcessSet, global_process_set
from ..common.types import Average
from .compression import Compression
from .gradients import GradientReducer


class _DistributedGradientTape(tf.GradientTape):
    """Takes over the recorded operations of ``tape``; reduces what ``gradient()`` returns."""

    def __init__(self, tape: tf.GradientTape, reducer: GradientReducer):
        super().__init__(persistent=tape._persistent,
                         watch_accessed_variables=tape._watch_accessed_variables)
        self._tape = tape._tape
        self._watched_variables = tape._watched_variables
        self._reducer = reducer

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient local to this rank (not reduced)."""
        self._reducer.register_local_variable(source)

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        reduced = self._reducer(tf.nest.flatten(grads), tf.nest.flatten(sources))
        return tf.nest.pack_sequence_as(grads, reduced)


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense="", device_sparse="",
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set: ProcessSet = global_process_set) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` averages (``op``) the gradients over the ranks of
    ``process_set``, all of them in one grouped allreduce (``groups`` splits it).

    ``compression``: ``Compression.fp16`` sends float gradients as float16.
    ``sparse_as_dense``: densify tf.IndexedSlices gradients (embeddings) instead of gathering
    their values and indices. ``gradient_predivide_factor``: see ``GradientReducer``.
    """
    reducer = GradientReducer("DistributedGradientTape", device_dense=device_dense,
                              device_sparse=device_sparse, compression=compression,
                              sparse_as_dense=sparse_as_dense, op=op,
                              gradient_predivide_factor=gradient_predivide_factor,
                              num_groups=num_groups, groups=groups, process_set=process_set)
    return _DistributedGradientTape(gradtape, reducer)


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense="",
                                   device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=Average,
                                   gradient_predivide_factor=1.0, num_groups=0, groups=None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A DistributedGradientTape that leaves the variables of ``local_layers`` (a Keras layer or
    a list of them) out of the reduction: each rank keeps its own gradient for them (divided by
    the set size when ``scale_local_gradients``, as in Horovod). More local variables can be added
    with ``tape.register_local_source(var)``."""
    reducer = GradientReducer("PartialDistributedGradientTape", device_dense=device_dense,
                              device_sparse=device_sparse, compression=compression,
                              sparse_as_dense=sparse_as_dense, op=op,
                              gradient_predivide_factor=gradient_predivide_factor,
                              num_groups=num_groups, groups=groups, process_set=process_set,
                              local_variables=local_layer_variables(local_layers),
                              scale_local_gradients=scale_local_gradients)
    return _DistributedGradientTape(gradtape, reducer)


def local_layer_variables(local_layers) -> list:
    """The trainable variables of ``local_layers``: None, a Keras layer or a list of them."""
    if local_layers is None:
        return []
    if not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    if not all(hasattr(layer, "trainable_weights") for layer in local_layers):
        raise ValueError("local_layers must be Keras layers")
    return [v for layer in local_layers for v in layer.trainable_weights]
