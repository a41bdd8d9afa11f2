"""Keras 3 callbacks for data-parallel ``model.fit`` (Horovod's ``hvd.callbacks``)::

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(), warmup_epochs=3),
    ]
    if hvd.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint("checkpoint-{epoch}.keras"))
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from ...common import ops as core
from ...common.basics import rank, size
from ..functions import broadcast_variables

__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "MetricAverageCallback"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, give every rank ``root_rank``'s model and optimizer variables
    (random initializations differ; a checkpoint may have been restored on the root only), but
    those in ``local_variables`` (a variable or a list of them), which each rank keeps.

    Keras 3 builds the model and the optimizer before ``on_train_begin``, so no step runs on
    unsynchronized weights.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple, set)):
            local_variables = [local_variables]
        if not all(isinstance(v, (tf.Variable, keras.Variable)) for v in local_variables):
            raise ValueError("local_variables must be variables (tf.Variable or keras.Variable)")
        self._local = {id(v) for v in local_variables}

    def register_local_var(self, var) -> None:
        """Leave ``var`` out of the broadcast: each rank keeps its own value."""
        self._local.add(id(var))

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        with tf.device(self.device):
            variables = list(self.model.variables)
            if self.model.optimizer is not None:
                variables += list(self.model.optimizer.variables)
            broadcast_variables([v for v in variables if id(v) not in self._local],
                                self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, replace every metric in the logs by its average over the ranks
    (one grouped allreduce), so that later callbacks (History, checkpoints, early stopping) and
    every rank see the same numbers. Put it before the callbacks that read the logs.

    Validation metrics computed on shards of different sizes are averaged unweighted; use
    ``hvd.weighted_average`` for an exact value.
    """

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(logs)
        averaged = core.grouped_allreduce([np.asarray(logs[k], dtype=np.float64) for k in keys],
                                          name=f"MetricAverageCallback.epoch{epoch}")
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


def _learning_rate(optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def _momentum_buffers(optimizer) -> list:
    """The velocity variables of SGD/RMSprop with momentum: buffers that already include the
    learning rate of past steps."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    momentum = getattr(optimizer, "momentum", 0.0)
    if not isinstance(momentum, (int, float)) or momentum <= 0:
        return []
    return list(getattr(optimizer, "momentums", None) or getattr(optimizer, "_momentums", []))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between ``start_epoch`` and
    ``end_epoch`` (exclusive): at the first batch of each epoch with ``staircase``, else at every
    batch with a fractional epoch. A constant ``multiplier`` m means ``m ** epoch``.

    ``momentum_correction`` (Goyal et al., 2017): when the rate changes by a factor r, the
    momentum buffers, which hold past rate-scaled gradients, are scaled by r too. Horovod does it
    by changing ``momentum`` for one batch; Keras 3 bakes ``momentum`` into the compiled step as a
    constant, so the buffers themselves are scaled, which is the same update.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda e: multiplier ** e)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError("Could not autodetect the number of steps per epoch. Please "
                                 f"specify the steps_per_epoch parameter to the "
                                 f"{type(self).__name__}()")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = _learning_rate(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        if self.momentum_correction and old_lr > 0 and new_lr != old_lr:
            ratio = new_lr / old_lr
            for buffer in _momentum_buffers(optimizer):
                buffer.assign(buffer * ratio)

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(epoch)
        else:
            self._adjust_learning_rate(epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``
    (Goyal et al., 2017): large-batch training scales the rate by the number of ranks, and
    starting there at once often diverges. ``initial_lr`` is the scaled rate."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0):
        def multiplier(epoch: float) -> float:
            # Shifted by one batch so that the rate reaches initial_lr on the last warm-up batch.
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_learning_rate(self.model.optimizer):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the model when ``monitor`` improves, on rank 0 only (the other ranks would write the
    same file at the same time). Put ``MetricAverageCallback`` before it so that the monitored
    value is the average over ranks."""

    def __init__(self, filepath, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_weights_only: bool = False, save_freq="epoch"):
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

    def on_train_batch_end(self, batch, logs=None):
        if rank() == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if rank() == 0:
            super().on_epoch_end(epoch, logs)
