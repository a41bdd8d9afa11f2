"""Data-parallel training on 2 ranks equals single-process large-batch training: the gradient
tape (dense and sparse gradients), the Keras 3 DistributedOptimizer in model.fit (with the
callbacks, and with backward_passes_per_step), then the callbacks' own contracts, checkpoints
written by rank 0 only, load_model, and the errors. Run by every rank of
``mpirun -np 2 python -m pytest`` (test_tensorflow_parallel.py).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from tf_setup import RANK, SIZE, assert_close, hvd

import hpc_horovod.tensorflow.keras as hvd_keras
from hpc_horovod.keras import callbacks as alias_callbacks

GLOBAL_BATCH, SAMPLES = 16, 64
LOCAL_BATCH = GLOBAL_BATCH // SIZE
rng = np.random.RandomState(0)  # the same data on every rank
X = rng.randint(0, 20, size=(SAMPLES, 3)).astype("int32")
Y = rng.randint(0, 3, size=(SAMPLES,)).astype("int32")
# Rank r's shard: its half of every global batch, in order, so that step i of every rank
# together sees exactly global batch i of the single-process run.
MINE = np.concatenate([np.arange(i, i + GLOBAL_BATCH)[RANK * LOCAL_BATCH:(RANK + 1) * LOCAL_BATCH]
                       for i in range(0, SAMPLES, GLOBAL_BATCH)])
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(autouse=True)
def _job():
    hvd.init()  # a new engine after a check that stopped it


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(20, 4),
                             keras.layers.Flatten(), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def assert_same_weights(a: keras.Model, b: keras.Model, rtol=1e-5):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=rtol, atol=1e-6)


def assert_equal_across_ranks(model: keras.Model):
    for w in model.get_weights():
        gathered = hvd.allgather_object(w)
        np.testing.assert_array_equal(gathered[0], gathered[1])


def train_with_tape(kwargs: dict, graph_ops: int):
    reference, model = make_model(0), make_model(0)
    ref_opt, opt = (keras.optimizers.SGD(0.1, momentum=0.9) for _ in range(2))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, **kwargs)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def reference_step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, reference(x, training=True))
        grads = tape.gradient(loss, reference.trainable_variables)
        ref_opt.apply_gradients(zip(grads, reference.trainable_variables))

    for i in range(0, SAMPLES, GLOBAL_BATCH):
        mine = slice(i // SIZE, (i + GLOBAL_BATCH) // SIZE)
        step(X[MINE][mine], Y[MINE][mine])
        reference_step(X[i:i + GLOBAL_BATCH], Y[i:i + GLOBAL_BATCH])
    assert_same_weights(model, reference)
    # One grouped op for the dense gradients (per group) and one for the sparse ones.
    graph = step.get_concrete_function(tf.TensorSpec([None, 3], tf.int32),
                                       tf.TensorSpec([None], tf.int32)).graph
    ops = [op.name for op in graph.get_operations() if op.type == "PyFunc"]
    assert len(ops) == graph_ops, (kwargs, ops)
    # the dense gradients travel as buckets: laid end to end (one request per bucket)
    concats = [op.name for op in graph.get_operations()
               if op.type == "ConcatV2" and "_Allreduce" in op.name]
    assert concats, (kwargs, [op.name for op in graph.get_operations()])


def test_tape_equals_large_batch():
    if RANK == 0:  # Keras numbers layers per process: rank 0's layer names now differ
        make_model(7)
    train_with_tape({}, 2)  # the embedding's gradient is sparse: gathered, not reduced
    train_with_tape({"sparse_as_dense": True}, 1)
    train_with_tape({"groups": 2}, 3)
    train_with_tape({"gradient_predivide_factor": 2.0}, 2)


def test_partial_tape():
    model = make_model(0)
    local = model.layers[-1]
    x, y = X[MINE][:LOCAL_BATCH], Y[MINE][:LOCAL_BATCH]
    with tf.GradientTape(persistent=True) as tape:
        loss = LOSS(y, model(x, training=True))
    plain = tape.gradient(loss, model.trainable_variables)
    grads = hvd.PartialDistributedGradientTape(tape, local_layers=local).gradient(
        loss, model.trainable_variables)
    local_ids = {id(v) for v in local.trainable_weights}
    for v, g, p in zip(model.trainable_variables, grads, plain):
        p = tf.convert_to_tensor(p).numpy()
        expected = p / SIZE if id(v) in local_ids else np.mean(hvd.allgather_object(p), axis=0)
        assert_close(tf.convert_to_tensor(g), expected, rtol=1e-5, atol=1e-7)


class Recorder(keras.callbacks.Callback):
    """Copies of the logs, learning rates and momentum buffers where it sits in the list."""

    def __init__(self):
        super().__init__()
        self.epoch_logs, self.lr_begin, self.buffer_begin, self.buffer_end = [], [], [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))

    def on_train_batch_begin(self, batch, logs=None):
        self.lr_begin.append(float(self.model.optimizer.learning_rate.numpy()))
        self.buffer_begin.append(self._buffer())

    def on_train_batch_end(self, batch, logs=None):
        self.buffer_end.append(self._buffer())

    def _buffer(self):
        momentums = getattr(self.model.optimizer, "momentums", [])
        return momentums[-1].numpy().copy() if momentums else None


def test_fit_equals_large_batch():
    """Different initial weights per rank; the broadcast callback makes them rank 0's."""
    reference, model = make_model(0), make_model(RANK)  # rank 0 holds the reference weights
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS, metrics=["accuracy"])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=LOSS, metrics=["accuracy"])
    raw, averaged = Recorder(), Recorder()
    history = model.fit(X[MINE], Y[MINE], batch_size=LOCAL_BATCH, epochs=2, shuffle=False,
                        verbose=0, validation_data=(X[MINE][:10 + 5 * RANK],
                                                    Y[MINE][:10 + 5 * RANK]),
                        callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), raw,
                                   alias_callbacks.MetricAverageCallback(), averaged])
    reference.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    assert_same_weights(model, reference, rtol=1e-4)
    assert_equal_across_ranks(model)
    # Metric averaging: every rank logs the mean of the ranks' own values.
    all_raw = hvd.allgather_object(raw.epoch_logs)
    assert hvd.allgather_object(history.history)[0] == hvd.allgather_object(history.history)[1]
    for epoch, logs in enumerate(averaged.epoch_logs):
        assert set(logs) == {"loss", "accuracy", "val_loss", "val_accuracy"}, logs
        for key, value in logs.items():
            assert_close(value, np.mean([r[epoch][key] for r in all_raw]), rtol=1e-6)
            assert history.history[key][epoch] == value
    assert all_raw[0][0]["val_loss"] != all_raw[1][0]["val_loss"], "shards must differ"


def test_backward_passes():
    """Two passes summed locally, one allreduce: SGD(lr) on the sum equals SGD(2 lr) on the
    mean over the 32 samples of two global batches (Horovod's default, no averaging)."""
    reference, model = make_model(0), make_model(0)
    reference.compile(optimizer=keras.optimizers.SGD(0.2, momentum=0.5), loss=LOSS)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5),
                                         backward_passes_per_step=2)
    model.compile(optimizer=optimizer, loss=LOSS)
    model.fit(X[MINE], Y[MINE], batch_size=LOCAL_BATCH, epochs=2, shuffle=False, verbose=0)
    reference.fit(X, Y, batch_size=2 * GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    assert_same_weights(model, reference)
    assert int(optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 4


def test_loss_scale_optimizer():
    """Wrapping the loss-scale optimizer: every rank checks the same averaged gradients."""
    model = make_model(RANK)
    inner = keras.optimizers.SGD(0.1)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(inner)),
                  loss=LOSS)
    model.fit(X[MINE], Y[MINE], batch_size=LOCAL_BATCH, epochs=1, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert int(model.optimizer.iterations.numpy()) == SAMPLES // GLOBAL_BATCH
    assert_equal_across_ranks(model)


def test_learning_rate_callbacks():
    model = make_model(0)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.2,
                                                                                momentum=0.9)),
                  loss=LOSS)
    recorder = Recorder()
    warmup = hvd_keras.callbacks.LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=2)
    model.fit(X[MINE], Y[MINE], batch_size=LOCAL_BATCH, epochs=3, shuffle=False, verbose=0,
              callbacks=[warmup, recorder])
    steps = SAMPLES // GLOBAL_BATCH
    expected = []
    for epoch in range(3):
        for batch in range(steps):
            e = min(epoch + batch / steps + 1 / steps, 2.0)
            expected.append(0.2 / SIZE * (e * (SIZE - 1) / 2 + 1))
    assert_close(recorder.lr_begin, expected, rtol=1e-6)
    assert_close(recorder.epoch_logs[-1]["lr"], 0.2, rtol=1e-6)
    # Momentum correction: when the rate changes by r the velocity is scaled by r.
    for i in range(1, len(expected)):
        ratio = recorder.lr_begin[i] / recorder.lr_begin[i - 1]
        assert_close(recorder.buffer_begin[i], recorder.buffer_end[i - 1] * ratio, rtol=1e-5)

    model.compile(optimizer=keras.optimizers.SGD(0.4), loss=LOSS)
    recorder = Recorder()
    schedule = hvd_keras.callbacks.LearningRateScheduleCallback(0.4, multiplier=0.5,
                                                                start_epoch=1)
    model.fit(X[MINE], Y[MINE], batch_size=LOCAL_BATCH, epochs=3, verbose=0,
              callbacks=[schedule, recorder])
    assert_close(recorder.lr_begin, [0.4] * steps + [0.2] * steps + [0.1] * steps, rtol=1e-6)


@pytest.fixture
def shared_dir():
    """A directory of rank 0's, the same on every rank (they share the machine)."""
    made = tempfile.mkdtemp(prefix="hvd-checkpoints-") if RANK == 0 else None
    path = Path(hvd.broadcast_object(made, root_rank=0))
    yield path
    hvd.barrier()
    if RANK == 0:
        shutil.rmtree(path)


def test_checkpoint_and_load_model(shared_dir):
    model = make_model(RANK)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1,
                                                                                momentum=0.9)),
                  loss=LOSS, metrics=["accuracy"])
    best = hvd_keras.callbacks.BestModelCheckpoint(str(shared_dir / f"rank{RANK}" / "best.keras"))
    model.fit(X[MINE], Y[MINE], batch_size=LOCAL_BATCH, epochs=2, verbose=0,
              validation_data=(X[:16], Y[:16]),
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd_keras.callbacks.MetricAverageCallback(), best])
    hvd.barrier()
    assert (shared_dir / "rank0" / "best.keras").is_file()
    assert not (shared_dir / "rank1").exists(), "only rank 0 writes checkpoints"

    loaded = hvd_keras.load_model(str(shared_dir / "rank0" / "best.keras"))
    assert isinstance(loaded.optimizer, keras.optimizers.SGD)
    assert hasattr(loaded.optimizer, "_hvd_reducer"), "load_model must re-wrap the optimizer"
    assert int(loaded.optimizer.iterations.numpy()) > 0, "the optimizer state must survive"
    plain = keras.saving.load_model(str(shared_dir / "rank0" / "best.keras"))
    assert type(plain.optimizer) is keras.optimizers.SGD, "checkpoints load without hvd"
    loaded.fit(X[MINE], Y[MINE], batch_size=LOCAL_BATCH, epochs=1, verbose=0)
    assert_equal_across_ranks(loaded)


def test_dispatch_and_errors():
    legacy = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    assert isinstance(legacy, tf.compat.v1.train.Optimizer)
    assert type(legacy).__name__ == "_DistributedOptimizer"
    wrapped = hvd.DistributedOptimizer(keras.optimizers.Adam(0.1))
    assert type(wrapped).__name__ == "Adam" and hasattr(wrapped, "_hvd_reducer")
    for bad, error in (("sgd", ValueError), (wrapped, ValueError)):
        try:
            hvd.DistributedOptimizer(bad)
        except error:
            pass
        else:
            raise AssertionError(f"DistributedOptimizer({bad!r}) must fail")
    try:
        hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Sum, gradient_predivide_factor=2)
    except ValueError as exc:
        assert "gradient_predivide_factor" in str(exc)
    else:
        raise AssertionError("gradient_predivide_factor needs op=Average")

    model = make_model(0)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=LOSS,
                  jit_compile=True)
    try:
        model.fit(X[MINE], Y[MINE], batch_size=LOCAL_BATCH, epochs=1, verbose=0)
    except ValueError as exc:
        assert "jit_compile=False" in str(exc), exc
    else:
        raise AssertionError("an XLA-compiled train step must be refused with a clear error")
