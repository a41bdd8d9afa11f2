"""``DistributedOptimizer`` for Keras 3 (TensorFlow backend), and ``load_model`` that re-wraps a
saved model's optimizer.

Keras 3 funnels every optimizer update through ``apply(grads, trainable_variables)``: both
``optimizer.apply_gradients(...)`` in a custom loop and the train step of ``model.fit``. The
distributed optimizer is a subclass of the wrapped optimizer's class that overrides ``apply`` to
combine the gradients across ranks (one grouped allreduce per step) before the wrapped class
updates the variables, so clipping, weight decay and loss-scale unscaling see averaged
gradients. The subclass keeps the wrapped class's name and module, so saved models load with
plain ``keras.saving.load_model`` too.

The collective is a host op (``tf.numpy_function``), which XLA cannot compile: Keras turns
``jit_compile`` on by default when a GPU is visible, so compile with
``model.compile(..., jit_compile=False)`` there (on CPU, Keras's default is already off). With a
``mixed_float16`` policy wrap the loss-scale optimizer itself,
``hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt))``, so that every rank sees the
same averaged gradients when it checks them for overflow.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf

from ...common.basics import ProcessSet, global_process_set
from ...common.types import Average, Sum
from ..compression import Compression
from ..gradients import GradientReducer
from ..tape import local_layer_variables


class _DistributedOptimizer:
    """Mixed in before a Keras optimizer class; see the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hvd_configure(GradientReducer(f"Distributed{type(self).__name__}"), 1, False)

    def _hvd_configure(self, reducer: GradientReducer, backward_passes_per_step: int,
                       average_aggregated_gradients: bool) -> None:
        self._hvd_reducer = reducer
        self._hvd_passes = backward_passes_per_step
        self._hvd_average_aggregated = average_aggregated_gradients

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        if self._hvd_passes > 1:
            # Local sums of the gradients between two allreduces, and the pass counter; they are
            # optimizer variables, so they are broadcast and saved with the rest of the state.
            self._hvd_accumulators = self.add_optimizer_variables(variables,
                                                                  "hvd_accumulated_gradient")
            self._hvd_pass_count = self.add_variable(shape=(), dtype="int64",
                                                     name="hvd_backward_passes")

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        variables = trainable_variables if trainable_variables is not None \
            else getattr(self, "_trainable_variables", None)
        if self._hvd_passes == 1:
            return super().apply(self._hvd_reducer(grads, variables), trainable_variables)
        return self._hvd_accumulate(grads, variables)

    def _hvd_accumulate(self, grads: list, variables: list) -> None:
        """``backward_passes_per_step`` > 1: sum gradients locally; every N-th pass allreduce
        the sums (divided by N with ``average_aggregated_gradients``) and apply them."""
        if not self.built:
            self.build(variables)
        accumulators = [self._hvd_accumulators[self._get_variable_index(v)] for v in variables]
        for acc, grad in zip(accumulators, grads):
            if grad is not None:
                acc.assign_add(tf.convert_to_tensor(grad))
        self._hvd_pass_count.assign_add(1)
        passes = self._hvd_passes
        present = [g is not None for g in grads]

        def communicate():
            sums = [tf.convert_to_tensor(a) if p else None for a, p in zip(accumulators, present)]
            reduced = self._hvd_reducer(sums, variables)
            if self._hvd_average_aggregated:
                reduced = [None if g is None else g / passes for g in reduced]
            super(_DistributedOptimizer, self).apply(reduced, variables)
            for acc in accumulators:
                acc.assign(tf.zeros(acc.shape, acc.dtype))

        tf.cond(tf.equal(tf.convert_to_tensor(self._hvd_pass_count) % passes, 0),
                communicate, lambda: None)


@functools.cache
def _distributed_class(base: type) -> type:
    return type(base.__name__, (_DistributedOptimizer, base),
                {"__module__": base.__module__, "__doc__": base.__doc__})


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name=None, device_dense="",
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set: ProcessSet = global_process_set):
    """A copy of ``optimizer`` (same class and configuration, fresh state: wrap it before
    training) that averages (``op``) the gradients over the ranks of ``process_set`` before each
    update::

        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
        model.compile(optimizer=opt, loss=...)   # jit_compile=False when a GPU is visible
        model.fit(..., callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

    ``backward_passes_per_step``: sum the gradients of that many batches locally and allreduce
    once per N batches (the update happens then; ``average_aggregated_gradients`` divides the sum
    by N). ``compression``, ``sparse_as_dense``, ``gradient_predivide_factor`` and ``groups`` are
    those of ``DistributedGradientTape``.
    """
    return _wrap(optimizer, name, backward_passes_per_step, average_aggregated_gradients,
                 device_dense=device_dense, device_sparse=device_sparse, compression=compression,
                 sparse_as_dense=sparse_as_dense, op=op,
                 gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
                 groups=groups, process_set=process_set)


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer, name=None,
                                device_dense="", device_sparse="", compression=Compression.none,
                                sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set: ProcessSet = global_process_set,
                                local_layers=None, scale_local_gradients=True):
    """A ``DistributedOptimizer`` that leaves the trainable variables of ``local_layers`` (a
    Keras layer or a list of them) out of the reduction: each rank updates them with its own
    gradient, divided by the set size when ``scale_local_gradients`` (as in Horovod)."""
    if op not in (Average, Sum):
        raise ValueError("PartialDistributedOptimizer supports op=Average and op=Sum")
    return _wrap(optimizer, name, backward_passes_per_step, average_aggregated_gradients,
                 device_dense=device_dense, device_sparse=device_sparse, compression=compression,
                 sparse_as_dense=sparse_as_dense, op=op,
                 gradient_predivide_factor=gradient_predivide_factor, groups=groups,
                 process_set=process_set, local_variables=local_layer_variables(local_layers),
                 scale_local_gradients=scale_local_gradients)


def _wrap(optimizer, name, backward_passes_per_step: int, average_aggregated_gradients: bool,
          **reducer_options):
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras optimizer, not "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got "
                         f"{backward_passes_per_step!r}")
    reducer = GradientReducer(name or f"Distributed{type(optimizer).__name__}", **reducer_options)
    distributed = _distributed_class(type(optimizer)).from_config(optimizer.get_config())
    distributed._hvd_configure(reducer, backward_passes_per_step, average_aggregated_gradients)
    return distributed


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none) -> keras.Model:
    """``keras.saving.load_model`` whose compiled optimizer comes back as a DistributedOptimizer,
    with its saved state (iterations, slots).

    ``custom_optimizers``: optimizer classes of your own used by the saved model.
    """
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or ()})
    model = keras.saving.load_model(filepath, custom_objects=objects)
    saved = getattr(model, "optimizer", None)
    if saved is not None:
        distributed = DistributedOptimizer(saved, compression=compression)
        if saved.built:
            distributed.build(model.trainable_variables)
            for target, source in zip(distributed.variables, saved.variables):
                target.assign(source)
        model.optimizer = distributed
    return model
