"""Elastic training for TensorFlow 2 (``hvd.elastic``): Horovod's ``run``,
``TensorFlowState`` and ``TensorFlowKerasState`` over the restart protocol of
:mod:`hpc_horovod.common.elastic`. Eager execution only: the states read and assign variables
directly (TF1 sessions are not supported)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from ..common.basics import init, rank, shutdown
from ..common.elastic import ObjectState, run_fn
from .functions import broadcast_object, broadcast_variables


def run(func):
    """Decorate the training function ``func(state, ...)`` for elastic training: the state is
    synced from rank 0 (from the last durable commit after a restart) before ``func`` runs, and
    a lost rank ends the process for a restart on the ranks that are left (see
    :func:`hpc_horovod.common.elastic.run_fn`)."""
    return run_fn(func, _reset)


def _reset():
    shutdown()
    init()


def _require_eager(kind: str) -> None:
    if not tf.executing_eagerly():
        raise ValueError(f"{kind} needs eager execution (TensorFlow 2's default); TF1 graphs "
                         "and sessions are not supported by hpc_horovod's elastic states")


def _optimizer_variables(optimizer) -> list:
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class _VariablesState(ObjectState):
    """Saves, restores and syncs a list of variables (``_variables()``) as numpy copies."""

    def __init__(self, **kwargs):
        self._values = [np.array(v.numpy()) for v in self._variables()]
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _variables(self) -> list:
        raise NotImplementedError()

    def save(self) -> None:
        self._values = [np.array(v.numpy()) for v in self._variables()]
        super().save()

    def restore(self) -> None:
        variables = self._variables()
        if len(variables) != len(self._values):
            raise ValueError(f"the state has {len(variables)} variables, the saved state "
                             f"{len(self._values)}: the model or optimizer changed shape")
        for variable, value in zip(variables, self._values):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        variables = self._variables()
        if variables:
            broadcast_variables(variables, root_rank=0)
        self._values = [np.array(v.numpy()) for v in variables]
        super().sync()

    def saved_state(self):
        return {**super().saved_state(), "variables": self._values}

    def load_saved_state(self, saved) -> None:
        super().load_saved_state(saved)
        self._values = list(saved["variables"])


class TensorFlowState(_VariablesState):
    """The state of a TensorFlow 2 training: ``variables`` (a list of ``tf.Variable``) and any
    other keyword argument as a plain object."""

    def __init__(self, variables=None, session=None, **kwargs):
        _require_eager("TensorFlowState")
        if session is not None:
            raise ValueError("TensorFlowState(session=...): TF1 sessions are not supported")
        if not variables:
            raise ValueError("TensorFlowState needs the variables to track: "
                             "TensorFlowState(variables=model.variables + opt.variables)")
        self.variables = list(variables)
        self.session = None
        super().__init__(**kwargs)

    def _variables(self) -> list:
        return self.variables


class TensorFlowKerasState(_VariablesState):
    """The state of a Keras model and its optimizer (``model.optimizer`` by default) and any
    other keyword argument as a plain object. The model must be built."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        _require_eager("TensorFlowKerasState")
        if not getattr(model, "built", True):
            raise ValueError("the model must be built first: call model.build(input_shape) "
                             "or run it on a batch")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        self.backend = backend
        super().__init__(**kwargs)

    def _variables(self) -> list:
        return list(self.model.variables) + _optimizer_variables(self.optimizer)


__all__ = ["TensorFlowKerasState", "TensorFlowState", "run"]
