"""Combining one step's gradients across ranks: what DistributedGradientTape and both
DistributedOptimizers share.

All gradients of a step go through one grouped allreduce (one graph op), not one call per
variable; ``groups`` splits them into several such calls when asked. Inside a call, dense
gradients of one dtype are laid end to end in buckets of about ``HOROVOD_BUCKET_BYTES``
(``common.buckets``, shared with torch), so the engine gets one request per bucket, reduced in
place in the bucket's own memory, and each gradient comes back as a slice of its bucket.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from ..common import buckets
from ..common.basics import ProcessSet, global_process_set
from ..common.types import Average
from .compression import Compression
from .mpi_ops import grouped_allreduce


class GradientReducer:
    """Callable ``(grads, variables) -> grads`` averaging (by default) gradients over ranks.

    ``gradient_predivide_factor`` (op=Average only) splits the averaging: dense gradients are
    scaled by ``1/factor`` before the sum and ``factor/size`` after it (tf.IndexedSlices are
    gathered, where the two cancel). ``groups``: an int (that many grouped calls over contiguous
    slices of the gradients) or a list of lists of variables (each list one call; variables in
    no list get a call each).

    ``local_variables`` keep their local gradient, not reduced (divided by the set size when
    ``scale_local_gradients``, as in Horovod, so that it weighs as much as a reduced one); more
    can be added with ``register_local_variable``.
    """

    def __init__(self, name: str, *, device_dense: str = "", device_sparse: str = "",
                 compression=Compression.none, sparse_as_dense: bool = False, op: int = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                 process_set: ProcessSet = global_process_set, local_variables=(),
                 scale_local_gradients: bool = True):
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if num_groups != 0:
            warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                          "removed in v0.23.0.", DeprecationWarning, stacklevel=3)
            if groups is None:
                groups = num_groups
        if groups is not None and not (isinstance(groups, list) or
                                       (isinstance(groups, int) and groups > 0)):
            raise ValueError("groups should be a non-negative integer or a list of list of "
                             "tf.Variable.")
        self.name = name
        self.device_dense = device_dense
        self.device_sparse = device_sparse
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.prescale_factor = 1.0 / gradient_predivide_factor if op == Average else 1.0
        self.postscale_factor = gradient_predivide_factor if op == Average else 1.0
        self.groups = groups
        self.process_set = process_set
        self._local = {id(v) for v in local_variables}
        self.scale_local_gradients = scale_local_gradients

    def register_local_variable(self, variable) -> None:
        """Keep ``variable``'s gradient local to this rank (not reduced)."""
        self._local.add(id(variable))

    def _index_groups(self, indices: list[int], variables) -> list[list[int]]:
        if self.groups is None:
            return [indices]
        if isinstance(self.groups, int):
            return buckets.split(indices, self.groups)
        if variables is None:
            raise ValueError("groups given as lists of variables need the variables of the "
                             "gradients")
        position = {id(variables[i]): i for i in indices}
        result, seen = [], set()
        for group in self.groups:
            members = [position[id(v)] for v in group if id(v) in position]
            seen.update(members)
            if members:
                result.append(sorted(members))
        result.extend([i] for i in indices if i not in seen)
        return result

    @tf.autograph.experimental.do_not_convert
    def __call__(self, grads, variables=None) -> list:
        grads = list(grads)
        variables = None if variables is None else list(variables)
        ps = self.process_set
        if not ps.included() or ps.size() == 1:
            return grads
        local = set()
        if self._local and variables is not None:
            local = {i for i, v in enumerate(variables) if id(v) in self._local}
        with tf.name_scope(self.name + "_Allreduce"):
            if self.sparse_as_dense:
                grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                         for g in grads]
            present = [i for i, g in enumerate(grads) if g is not None and i not in local]
            for group in self._index_groups(present, variables):
                dense = [i for i in group if not isinstance(grads[i], tf.IndexedSlices)]
                sparse = [i for i in group if isinstance(grads[i], tf.IndexedSlices)]
                for members, pre, post in ((dense, self.prescale_factor, self.postscale_factor),
                                           (sparse, 1.0, 1.0)):
                    if not members:
                        continue
                    assigned = (_buckets([grads[i] for i in members], buckets.bucket_bytes())
                                if members is dense else [[k] for k in range(len(members))])
                    tensors = [_flatten([grads[members[k]] for k in bucket])
                               for bucket in assigned]
                    reduced = grouped_allreduce(
                        tensors, device_dense=self.device_dense,
                        device_sparse=self.device_sparse, compression=self.compression,
                        op=self.op, prescale_factor=pre, postscale_factor=post, process_set=ps)
                    for bucket, flat in zip(assigned, reduced):
                        parts = _unflatten(flat, [grads[members[k]] for k in bucket])
                        for k, g in zip(bucket, parts):
                            grads[members[k]] = g
        if self.scale_local_gradients:
            for i in local:
                if grads[i] is not None:
                    grads[i] = _scale(grads[i], 1.0 / ps.size())
        return grads


def _static_bytes(grad) -> int | None:
    """Bytes of a dense gradient whose shape is known when the graph is built, else None."""
    shape = tf.TensorShape(grad.shape)
    if not shape.is_fully_defined():
        return None
    return shape.num_elements() * tf.as_dtype(grad.dtype).size


def _buckets(grads: list, cap: int) -> list[list[int]]:
    """Positions of ``grads`` in buckets (``common.buckets.assign``), filled from the last
    gradient back (the first ready in a backward pass), as torch DDP does."""
    last_first = list(reversed(range(len(grads))))
    items = [(tf.as_dtype(grads[k].dtype), _static_bytes(grads[k])) for k in last_first]
    return [[last_first[i] for i in bucket] for bucket in buckets.assign(items, cap)]


def _flatten(grads: list):
    """One tensor: the gradient itself, or the gradients of a bucket end to end."""
    if len(grads) == 1:
        return grads[0]
    return tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)


def _unflatten(flat, grads: list) -> list:
    """``flat`` cut back into tensors of ``grads``' shapes."""
    if len(grads) == 1:
        return [flat]
    shapes = [tf.TensorShape(g.shape) for g in grads]
    parts = tf.split(flat, [shape.num_elements() for shape in shapes])
    return [tf.reshape(part, shape) for part, shape in zip(parts, shapes)]


def _scale(grad, factor: float):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices,
                                grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)
