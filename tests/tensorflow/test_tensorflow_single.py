"""hpc_horovod.tensorflow in one process (a job of size 1, no MPI): the API's shapes and values,
the wrappers' argument checks, the errors, and the Keras optimizer's class and serialization."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from support import single_process_job  # noqa: E402

import hpc_horovod.keras as hvd_keras_alias  # noqa: E402
import hpc_horovod.tensorflow as hvd  # noqa: E402
import hpc_horovod.tensorflow.keras as hvd_keras  # noqa: E402
from hpc_horovod.tensorflow.gradients import (  # noqa: E402
    GradientReducer,
    _buckets,
    _flatten,
    _unflatten,
)
from hpc_horovod.tensorflow.mpi_ops import _graph_name  # noqa: E402


@pytest.fixture
def single(monkeypatch):
    with single_process_job(hvd, monkeypatch) as job:
        yield job


def both_modes(fn):
    return fn(), tf.function(fn)()


def test_collectives_of_a_single_process(single):
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    for out in both_modes(lambda: [hvd.allreduce(x), hvd.allreduce(x, op=hvd.Sum),
                                   hvd.allgather(x), hvd.broadcast(x, 0), hvd.alltoall(x),
                                   hvd.reducescatter(x), hvd.size_op(), hvd.rank_op()]):
        for tensor in out[:6]:
            np.testing.assert_allclose(tensor, x)
        assert [int(out[6]), int(out[7])] == [1, 0]
    received, splits = hvd.alltoall(x, splits=[2])
    np.testing.assert_allclose(received, x)
    assert splits.numpy().tolist() == [2] and splits.dtype == tf.int32
    assert int(hvd.join()) == 0


def test_graph_outputs_keep_static_shapes(single):
    recorded = {}

    @tf.function
    def record(x):
        recorded.update(allreduce=hvd.allreduce(x).shape, allgather=hvd.allgather(x).shape,
                        broadcast=hvd.broadcast(x, 0).shape, alltoall=hvd.alltoall(x).shape,
                        grouped=hvd.grouped_allreduce([x, x[0]])[1].shape,
                        reducescatter=hvd.reducescatter(x).shape, size=hvd.size_op().shape)
        return x

    record(tf.zeros([5, 3]))
    assert {k: v.as_list() for k, v in recorded.items()} == {
        "allreduce": [5, 3], "allgather": [None, 3], "broadcast": [5, 3], "alltoall": [None, 3],
        "grouped": [3], "reducescatter": [5, 3], "size": []}


def test_graph_ops_are_named_by_their_rank_in_the_graph(single):
    """Names that depend only on the order collectives are built in, not on tensor or layer
    names, so that every rank tracing the same code agrees on them."""
    for _ in range(2):  # every graph counts from 0
        with tf.Graph().as_default():
            assert [_graph_name("A"), _graph_name("A"), _graph_name("B")] == ["A.0", "A.1", "B.0"]

    @tf.function
    def twice(x):
        return hvd.allreduce(x) + hvd.allreduce(x)

    np.testing.assert_allclose(twice(tf.ones(2)), [2.0, 2.0])
    ops = [op for op in twice.get_concrete_function(tf.TensorSpec([2])).graph.get_operations()
           if op.type == "PyFunc"]
    assert len(ops) == 2


def test_distributed_tape_of_one_process_is_the_plain_tape(single):
    v = tf.Variable([1.0, 2.0])
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(v * v)
    plain = tape.gradient(loss, v)
    np.testing.assert_allclose(hvd.DistributedGradientTape(tape).gradient(loss, v), plain)
    nested = hvd.DistributedGradientTape(tape).gradient(loss, {"v": [v]})
    np.testing.assert_allclose(nested["v"][0], plain)


def test_weighted_average_and_compression(single):
    out = hvd.weighted_average({"acc": 0.75, "loss": tf.constant([1.0, 2.0])}, 12)
    np.testing.assert_allclose(out["acc"], 0.75)
    np.testing.assert_allclose(out["loss"], [1.0, 2.0])
    half, ctx = hvd.Compression.fp16.compress(tf.constant([1.5], tf.float64))
    assert half.dtype == tf.float16
    assert hvd.Compression.fp16.decompress(half, ctx).dtype == tf.float64
    ints, ctx = hvd.Compression.fp16.compress(tf.constant([3]))
    assert ints.dtype == tf.int32 and ctx is None


def test_bad_arguments_are_refused_with_the_fix(single):
    with pytest.raises(ValueError, match="dtype string"):
        hvd.allreduce(tf.constant(["text"]))
    with pytest.raises(ValueError, match="jit_compile=False"):
        tf.function(hvd.allreduce, jit_compile=True)(tf.ones(2))
    with pytest.raises(ValueError, match="op != Average"):
        GradientReducer("x", op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="groups should be"):
        GradientReducer("x", groups=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert GradientReducer("x", num_groups=2).groups == 2
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)
    with pytest.raises(ValueError, match="not a member"):
        hvd.broadcast(tf.ones(1), root_rank=3)
    with pytest.raises(TypeError, match="Keras optimizer"):
        hvd_keras.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer())
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="doesn't inherit"):
        hvd.DistributedOptimizer(object())
    with pytest.raises(ValueError, match="has no gradient"):
        with tf.GradientTape() as tape:
            x = tf.constant([1.0])
            tape.watch(x)
            y = hvd.allreduce(x, op=hvd.Min)
        tape.gradient(y, x)


def test_keras_optimizer_is_a_subclass_with_the_same_config():
    sgd = keras.optimizers.SGD(0.3, momentum=0.8, nesterov=True, name="mine")
    wrapped = hvd_keras.DistributedOptimizer(sgd)
    assert isinstance(wrapped, keras.optimizers.SGD)
    assert type(wrapped).__name__ == "SGD" and type(wrapped).__module__ == type(sgd).__module__
    assert wrapped.get_config() == sgd.get_config()
    # Saved models name the wrapped class: they load without hpc_horovod.
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(wrapped))
    assert type(restored) is keras.optimizers.SGD and restored.get_config() == sgd.get_config()
    assert type(hvd_keras.DistributedOptimizer(keras.optimizers.Adam())) is \
        type(hvd_keras.DistributedOptimizer(keras.optimizers.Adam()))


def test_keras_fit_save_and_load_in_one_process(single, tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1,
                                                                               momentum=0.9)),
                  loss="mse")
    x, y = np.random.rand(32, 4).astype("float32"), np.random.rand(32, 3).astype("float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd_keras_alias.callbacks.MetricAverageCallback()])
    model.save(tmp_path / "model.keras")
    loaded = hvd_keras.load_model(tmp_path / "model.keras")
    assert int(loaded.optimizer.iterations.numpy()) == 4
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy())
    # The Keras API returns tensors, as Horovod's does in eager mode.
    for out in (hvd_keras.allreduce([1.0, 2.0]), hvd_keras.broadcast(np.arange(3), 0),
                hvd_keras.allgather(np.ones((2, 1))), hvd_keras.reducescatter(np.ones((2, 1))),
                hvd_keras.allreduce(keras.metrics.Mean()(tf.constant([4.0])))):
        assert isinstance(out, tf.Tensor), type(out)
    assert hvd_keras.allreduce([1.0, 2.0]).numpy().tolist() == [1.0, 2.0]
    assert hvd_keras.broadcast(np.arange(3), 0).numpy().tolist() == [0, 1, 2]
    assert hvd_keras.allgather(np.ones((2, 1))).shape == (2, 1)


def test_alias_modules_are_the_keras_binding():
    assert hvd_keras_alias.DistributedOptimizer is hvd_keras.DistributedOptimizer
    assert hvd_keras_alias.callbacks.BroadcastGlobalVariablesCallback is \
        hvd_keras.callbacks.BroadcastGlobalVariablesCallback
    assert hvd.keras is hvd_keras


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_collectives_run_their_own_cycles(leaves_engine_asleep, graph):
    """A TensorFlow collective waits for what it submits, so it leaves the engine thread
    asleep, in eager mode and inside a graph."""
    from hpc_horovod.common import ops

    def step():
        return hvd.allreduce(tf.ones(2)), hvd.broadcast(tf.ones(2), 0), hvd.allgather(tf.ones(2))

    leaves_engine_asleep(tf.function(step) if graph else step,
                         lambda: ops.allreduce_async(np.ones(2)))


def test_sync_batch_normalization_of_one_process_saves_and_loads(single, tmp_path):
    """In a job of one it is Keras's batch normalization; saved models load it back."""
    x = np.random.RandomState(0).rand(8, 3).astype("float32")
    sync, plain = hvd.SyncBatchNormalization(), keras.layers.BatchNormalization()
    np.testing.assert_allclose(sync(x, training=True), plain(x, training=True), rtol=1e-6)
    assert sync.name.startswith("sync_batch_normalization")
    model = keras.Sequential([keras.Input((3,)), hvd.SyncBatchNormalization(momentum=0.7)])
    model.save(tmp_path / "bn.keras")
    loaded = keras.saving.load_model(tmp_path / "bn.keras")
    assert type(loaded.layers[0]) is hvd.SyncBatchNormalization
    assert loaded.layers[0].momentum == 0.7
    with pytest.raises(ValueError, match="synchronized"):
        hvd.SyncBatchNormalization(synchronized=True)


def test_dense_gradients_go_in_buckets_of_one_dtype_from_the_last_back():
    """The tape's buckets (DDP's rule, common.buckets): one dtype each, closed once they hold
    the cap, filled from the last gradient back; a gradient of a shape known only when the
    graph runs alone."""
    f32 = [tf.zeros([4]), tf.zeros([2, 2]), tf.zeros([100]), tf.zeros([1])]  # 16, 16, 400, 4 B
    half = tf.zeros([8], tf.float16)
    assert _buckets(f32, 40) == [[3, 2], [1, 0]]
    assert _buckets(f32, 20) == [[3, 2], [1, 0]]
    assert _buckets(f32, 16) == [[3, 2], [1], [0]]
    assert _buckets(f32, 0) == [[3], [2], [1], [0]]  # HOROVOD_BUCKET_BYTES=0: none shared
    assert _buckets([f32[0], half, f32[1]], 1 << 20) == [[2, 0], [1]]

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def unknown(x):
        assert _buckets([x, f32[0], f32[1]], 1 << 20) == [[0], [2, 1]]
        return x

    unknown(tf.ones([3]))


def test_a_bucket_flattens_and_cuts_back_to_the_gradients():
    grads = [tf.reshape(tf.range(6.0), [2, 3]), tf.constant([7.0]), tf.constant([[8.0], [9.0]])]
    flat = _flatten(grads)
    assert flat.numpy().tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9]
    for back, grad in zip(_unflatten(flat, grads), grads):
        assert back.shape == grad.shape and np.array_equal(back.numpy(), grad.numpy())
    assert _flatten(grads[:1]) is grads[0] and _unflatten(grads[0], grads[:1]) == [grads[0]]


def test_sync_batch_normalization_takes_horovods_fused_argument(single):
    """Horovod's ``fused=False`` is accepted (Keras 3's layer no longer takes it); fused=True is
    refused as Horovod refuses it."""
    layer = hvd.SyncBatchNormalization(axis=1, fused=False)
    assert layer.axis == 1
    for fused in (True, None):
        with pytest.raises(ValueError, match="fused=True"):
            hvd.SyncBatchNormalization(fused=fused)
