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
    """Takes over the recorded operations of ``tape``; reduces what ``gradient()`` returns.

    Variables in ``local_sources`` keep their local gradient (divided by the set size when
    ``scale_local_gradients``, as in Horovod).
    """

    def __init__(self, tape: tf.GradientTape, reducer: GradientReducer, local_sources=(),
                 scale_local_gradients: bool = True):
        super().__init__(persistent=tape._persistent,
                         watch_accessed_variables=tape._watch_accessed_variables)
        self._tape = tape._tape
        self._watched_variables = tape._watched_variables
        self._reducer = reducer
        self._local_sources = {id(v) for v in local_sources}
        self._scale_local_gradients = scale_local_gradients

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient local to this rank (not reduced)."""
        self._local_sources.add(id(source))

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        shared = [i for i, s in enumerate(flat_sources) if id(s) not in self._local_sources]
        reduced = self._reducer([flat_grads[i] for i in shared], [flat_sources[i] for i in shared])
        out = list(flat_grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        if self._scale_local_gradients and len(shared) < len(out):
            n = self._reducer.process_set.size()
            for i, g in enumerate(out):
                if g is not None and id(flat_sources[i]) in self._local_sources:
                    out[i] = _scale(g, 1.0 / n)
        return tf.nest.pack_sequence_as(grads, out)


def _scale(grad, factor: float):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


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
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    local_sources = [v for layer in local_layers for v in layer.trainable_weights]
    reducer = GradientReducer("PartialDistributedGradientTape", device_dense=device_dense,
                              device_sparse=device_sparse, compression=compression,
                              sparse_as_dense=sparse_as_dense, op=op,
                              gradient_predivide_factor=gradient_predivide_factor,
                              num_groups=num_groups, groups=groups, process_set=process_set)
    return _DistributedGradientTape(gradtape, reducer, local_sources, scale_local_gradients)
