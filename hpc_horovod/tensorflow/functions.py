"""Helpers built on the collectives: start every rank from the same variables, exchange Python
objects, and average a validation metric correctly over shards of different sizes."""

from __future__ import annotations

import tensorflow as tf

from ..common.basics import ProcessSet, global_process_set
from ..common.ops import allgather_object, broadcast_object
from ..common.types import Sum
from .mpi_ops import _allreduce, broadcast_

__all__ = ["allgather_object", "broadcast_object", "broadcast_variables", "weighted_average"]


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables, root_rank: int,
                        process_set: ProcessSet = global_process_set):
    """Assign every variable the value it has on ``root_rank``, in one grouped broadcast.

    ``variables``: tf.Variables or Keras variables, e.g. ``model.variables`` and
    ``optimizer.variables``. Eager: done on return. Graph mode: returns the op to run.
    """
    values = broadcast_(variables, root_rank, process_set=process_set)
    return None if tf.executing_eagerly() else tf.group(*values)


@tf.autograph.experimental.do_not_convert
def weighted_average(value, count, name=None, process_set: ProcessSet = global_process_set):
    """The mean over ranks of ``value`` weighted by ``count``: sum(value*count) / sum(count).

    The way to combine per-rank validation results: with ``value`` the metric a rank measured on
    its shard and ``count`` the number of samples in it, the result equals the metric over the
    whole validation set even when shards differ in size (a short last batch), which averaging
    the per-rank values does not. ``value`` may be a tensor, a number, or a (nested) dict or list
    of them, e.g. ``model.evaluate(..., return_dict=True)``; the result has the same structure,
    as float64 tensors, computed with a single allreduce::

        logs = model.evaluate(x_shard, y_shard, return_dict=True, verbose=0)
        logs = hvd.weighted_average(logs, len(x_shard))
    """
    flat = [tf.cast(tf.convert_to_tensor(v), tf.float64) for v in tf.nest.flatten(value)]
    count = tf.reshape(tf.cast(tf.convert_to_tensor(count), tf.float64), [1])
    packed = tf.concat([tf.reshape(v, [-1]) * count for v in flat] + [count], axis=0)
    total = _allreduce(packed, name=name, op=Sum, process_set=process_set)
    means = total[:-1] / total[-1]
    out, offset = [], 0
    for v in flat:
        n = v.shape.num_elements()
        if n is None:
            raise ValueError("weighted_average needs values with a static shape")
        out.append(tf.reshape(means[offset:offset + n], tf.shape(v)))
        offset += n
    return tf.nest.pack_sequence_as(value, out)
