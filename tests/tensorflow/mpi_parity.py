"""Behaviours that Horovod's TensorFlow and Keras tests expect, on 2 ranks: many independent
collectives in one graph (tf.compat.v1 Session.run and tf.function) never deadlock, the
broadcast's gradient in a graph, Horovod's error types, uint16, grouped_reducescatter and
broadcast_, tf.IndexedSlices rules, the Keras API's tensors, PartialDistributedOptimizer, the
broadcast callback's local variables and SyncBatchNormalization."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tf_setup import RANK, SIZE, assert_close, hvd, in_both_modes

import hpc_horovod
import hpc_horovod.tensorflow.keras as hvd_keras

R = float(RANK + 1)  # this rank's scale: 1 on rank 0, 2 on rank 1
SUM = 3.0


@pytest.fixture(autouse=True)
def _job():
    hvd.init()  # a new engine after a check that stopped it


def independent_collectives(count: int, feed=None) -> tuple[list, list]:
    """``count`` collectives no one of which depends on another (alternately allreduce and
    allgather), with the values every rank must get."""
    ops, expected = [], []
    for i in range(count):
        if i % 2:
            ops.append(hvd.allgather(tf.fill([RANK + 1], float(i))))
            expected.append([float(i)] * 3)
        else:
            base = tf.fill([i + 1], float(i + 1)) if feed is None else feed * float(i + 1)
            ops.append(hvd.allreduce(base * R, op=hvd.Sum))
            expected.append([SUM * (i + 1)] * (i + 1 if feed is None else 1))
    return ops, expected


def test_tf1_session_runs_20_independent_collectives():
    """Four inter-op threads per session let each rank start the collectives in its own order:
    without an order common to the ranks they wait for each other forever."""
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=4)
    with tf.Graph().as_default():
        ops, expected = independent_collectives(18)
        noise = [hvd.allreduce(tf.random.uniform([4], seed=i), op=hvd.Max) for i in range(2)]
        with tf.compat.v1.Session(config=config) as sess:
            for _ in range(5):
                out = sess.run(ops + noise)
                for value, want in zip(out, expected):
                    assert_close(value, want)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1])
        ops, expected = independent_collectives(20, feed=x)
        with tf.compat.v1.Session(config=config) as sess:
            for _ in range(5):
                out = sess.run(ops, {x: [1.0]})
                for value, want in zip(out, expected):
                    assert_close(value, want)


def test_tf1_order_never_runs_what_needs_other_feeds():
    """A collective built after another that needs a placeholder does not wait for it: the
    variables' broadcast built after a training step runs without the step's feed."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2])
        v = tf.Variable([R, R])
        step = hvd.allreduce(x * v, op=hvd.Sum)
        bcast = hvd.broadcast_variables([v], root_rank=1)
        later = hvd.allreduce(x + 1.0, op=hvd.Sum)  # needs only x: ordered after `step`
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(bcast)
            assert_close(sess.run(v), [2.0, 2.0])
            assert_close(sess.run(later, {x: [1.0, 2.0]}), [4.0, 6.0])
            assert_close(sess.run([step, later], {x: [1.0, 1.0]}), [[4.0, 4.0], [4.0, 4.0]])


def test_tf_function_runs_20_independent_collectives():
    @tf.function
    def many():
        return independent_collectives(20)[0]

    for _ in range(5):
        out = many()
        for i, value in enumerate(out):
            want = [float(i)] * 3 if i % 2 else [SUM * (i + 1)] * (i + 1)
            assert_close(value, want)


def test_broadcast_gradient_in_a_tf1_graph():
    """The non-root ranks run the gradient's allreduce too (they used to drop it)."""
    with tf.Graph().as_default():
        x = tf.constant([1.0, 2.0, 3.0]) * R
        y = hvd.broadcast(x, root_rank=1)
        grad = tf.gradients(tf.reduce_sum(y * tf.constant([1.0, 2.0, 3.0]) * R), x)[0]
        with tf.compat.v1.Session() as sess:
            for _ in range(2):
                # The root gets the average of every rank's gradient, the others zeros.
                assert_close(sess.run(grad), np.array([1.0, 2.0, 3.0]) * 1.5 * (RANK == 1))


def expect(error, fn, text: str = ""):
    try:
        fn()
    except error as exc:
        assert text.lower() in str(exc).lower(), exc
        return exc
    raise AssertionError(f"{fn} must raise {error.__name__}")


def test_error_types():
    shape = [2] if RANK == 0 else [3]
    exc = expect(tf.errors.FailedPreconditionError,
                 lambda: hvd.allreduce(tf.ones(shape), name="parity.shape"), "mismatched")
    assert isinstance(exc, hpc_horovod.HorovodInternalError)
    dtype = tf.float32 if RANK == 0 else tf.int32
    expect(tf.errors.FailedPreconditionError,
           lambda: hvd.allgather(tf.ones([2], dtype), name="parity.dtype"), "data type")
    expect(tf.errors.FailedPreconditionError,
           lambda: hvd.broadcast(tf.ones(shape), 0, name="parity.bshape"), "mismatched")
    # Inside a graph TensorFlow reports a failed tf.numpy_function as UnknownError.
    expect(tf.errors.UnknownError,
           lambda: tf.function(lambda: hvd.allreduce(tf.ones(shape), name="parity.g"))(),
           "mismatched")
    # Bad alltoall splits: InvalidArgumentError, eagerly and in a graph.
    expect(tf.errors.InvalidArgumentError, lambda: hvd.alltoall(tf.ones([3])), "divisible")
    expect(tf.errors.InvalidArgumentError,
           lambda: hvd.alltoall(tf.ones([3]), splits=[1, 1]), "sum to")
    expect(tf.errors.InvalidArgumentError,
           lambda: tf.function(lambda: hvd.alltoall(tf.ones([3]), splits=[2, 2]))(), "sum to")
    # tf.IndexedSlices: Sum and Average only, no scale factors.
    slices = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([RANK]), tf.constant([2, 3]))
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        expect(NotImplementedError, lambda op=op: hvd.allreduce(slices, op=op))
        expect(NotImplementedError,
               lambda op=op: hvd.grouped_allreduce([slices, tf.ones([2])], op=op))
    # ... before the dense tensors' own checks (Adasum refuses integers with ValueError)
    int_slices = tf.IndexedSlices(tf.ones([1, 3], tf.int32), tf.constant([RANK]))
    expect(NotImplementedError,
           lambda: hvd.grouped_allreduce([int_slices, tf.ones([3], tf.int32)], op=hvd.Adasum))
    expect(NotImplementedError, lambda: hvd.allreduce(slices, op=hvd.Sum, prescale_factor=0.5))
    expect(NotImplementedError, lambda: hvd.allreduce(slices, op=hvd.Sum, postscale_factor=2.0))
    hvd.barrier()


def test_uint16():
    def moved():
        mine = tf.constant([65000 + RANK, 7], tf.uint16)[:RANK + 1]
        return {"allgather": hvd.allgather(mine),
                "grouped": hvd.grouped_allgather([mine, tf.constant([RANK], tf.uint16)]),
                "alltoall": hvd.alltoall(tf.constant([1, 2], tf.uint16) if RANK == 0 else
                                         tf.constant([60001, 60002], tf.uint16)),
                "broadcast": hvd.broadcast(tf.constant([RANK + 65530], tf.uint16), 1)}
    out = in_both_modes(moved)
    assert out["allgather"].dtype == np.uint16
    assert out["allgather"].tolist() == [65000, 65001, 7]
    assert out["grouped"][1].tolist() == [0, 1] and out["grouped"][1].dtype == np.uint16
    assert out["alltoall"].tolist() == [[1, 60001], [2, 60002]][RANK]
    assert out["broadcast"].tolist() == [65531]
    expect(ValueError, lambda: hvd.allreduce(tf.constant([1], tf.uint16)), "uint16")


def test_grouped_reducescatter_and_gradient():
    rows = lambda: [tf.reshape(tf.range(6, dtype=tf.float32), [3, 2]) * R,  # noqa: E731
                    tf.fill([4], R)]
    out = in_both_modes(lambda: hvd.grouped_reducescatter(rows(), op=hvd.Sum))
    full = np.arange(6, dtype=np.float32).reshape(3, 2) * SUM
    assert_close(out[0], full[:2] if RANK == 0 else full[2:])
    assert_close(out[1], [SUM, SUM])
    averaged = in_both_modes(lambda: hvd.grouped_reducescatter(rows()))
    assert_close(averaged[1], [1.5, 1.5])
    graph = tf.function(lambda: hvd.grouped_reducescatter(rows())).get_concrete_function().graph
    assert len([op for op in graph.get_operations() if op.type == "PyFunc"]) == 1

    x = tf.Variable([1.0, 2.0, 3.0, 4.0])

    def grad():
        with tf.GradientTape() as tape:
            a, b = hvd.grouped_reducescatter([x * R, x * 2.0], op=hvd.Sum)
            loss = tf.reduce_sum(a * [1.0, 2.0]) + tf.reduce_sum(b)
        return tape.gradient(loss, x)
    # d/dx: allgather of the gradients times the set size, times R resp. 2.
    assert_close(in_both_modes(grad), R * 2 * np.array([1.0, 2.0, 1.0, 2.0]) + 2 * 2)


def test_float16_reducescatter_scaling_rounds_as_horovod():
    """float16 scaled in float32 and rounded once per step: Horovod's exact values."""
    rng = np.random.RandomState(5)
    tensor = tf.constant(rng.uniform(-100, 100, [8, 3]), tf.float16)  # the same on both ranks

    def scaled_by(factor: float):
        return lambda: [hvd.reducescatter(tensor, op=hvd.Sum, prescale_factor=factor),
                        hvd.reducescatter(tensor, op=hvd.Sum, postscale_factor=factor),
                        hvd.allreduce(tensor, op=hvd.Sum, prescale_factor=factor)]

    for factor in rng.uniform(size=4):
        pre, post, allreduced = in_both_modes(scaled_by(float(factor)))
        mine = slice(4 * RANK, 4 * RANK + 4)
        once = tf.cast(tf.cast(tensor, tf.float32) * np.float32(factor), tf.float16) * 2
        np.testing.assert_array_equal(pre, once.numpy()[mine])
        np.testing.assert_array_equal(allreduced, once.numpy())
        twice = tf.cast(tf.cast(tensor * 2, tf.float32) * np.float32(factor), tf.float16)
        np.testing.assert_array_equal(post, twice.numpy()[mine])


def test_broadcast_in_place():
    v = tf.Variable(tf.fill([3], R))
    w = tf.Variable([RANK], dtype=tf.int64)
    values = hvd.broadcast_([v, w], root_rank=1)
    assert_close(v, [2.0] * 3)
    assert w.numpy().tolist() == [1]
    assert_close(values[0], [2.0] * 3)
    u, k = tf.Variable(tf.fill([2], R)), keras.Variable(np.full([2], R, np.float32))
    out = tf.function(lambda: hvd.broadcast_([u, k], root_rank=0))()
    assert_close(out, [[1.0, 1.0]] * 2)
    assert_close(u, [1.0, 1.0])
    assert_close(k, [1.0, 1.0])
    with tf.Graph().as_default():
        g = tf.Variable([R])
        new_values = hvd.broadcast_([g], root_rank=1)
        with tf.compat.v1.Session() as sess:
            sess.run(g.initializer)
            assert_close(sess.run(new_values), [[2.0]])
    expect(ValueError, lambda: hvd.broadcast_([tf.ones(2)], 0), "variables")


def test_integer_indexed_slices_average_to_floats():
    slices = tf.IndexedSlices(tf.constant([[3, 4]], tf.int32) * (RANK + 1), tf.constant([RANK]),
                              tf.constant([2, 2]))
    out = hvd.allreduce(slices)
    assert out.values.dtype == tf.float64, out.values.dtype
    assert_close(out.values, [[1.5, 2.0], [3.0, 4.0]])
    summed = hvd.allreduce(slices, op=hvd.Sum)
    assert summed.values.dtype == tf.int32


def test_keras_api_returns_tensors():
    val_loss = keras.metrics.Mean()
    val_loss.update_state(R)
    averaged = hvd_keras.allreduce(val_loss.result())
    assert isinstance(averaged, tf.Tensor)
    assert_close(averaged.numpy(), 1.5)
    assert_close(tf.math.sqrt(averaged * 6.0), 3.0)
    gathered = hvd_keras.allgather(tf.fill([RANK + 1], R))
    assert isinstance(gathered, tf.Tensor) and gathered.numpy().tolist() == [1.0, 2.0, 2.0]
    assert hvd_keras.broadcast(tf.constant(RANK), 1).numpy() == 1
    assert_close(hvd_keras.reducescatter(np.ones([2, 1]) * R).numpy(), [[1.5]])


def dense_model(seed: int, init=None) -> keras.Model:
    keras.utils.set_random_seed(seed)
    kw = {} if init is None else {"kernel_initializer": init, "bias_initializer": init}
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh", **kw),
                             keras.layers.Dense(2, **kw)])


def test_partial_distributed_optimizer():
    """Local layers take this rank's own gradient divided by the set size; the others the
    average, for the Keras optimizer built both ways."""
    x = np.random.RandomState(RANK).rand(4, 3).astype("float32")
    y = np.random.RandomState(10 + RANK).rand(4, 2).astype("float32")
    for make in (hvd_keras.PartialDistributedOptimizer, hvd.PartialDistributedOptimizer):
        model = dense_model(0)
        local = model.layers[-1]
        opt = make(keras.optimizers.SGD(1.0), local_layers=[local])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
        before = [v.numpy() for v in model.trainable_variables]
        opt.apply(grads, model.trainable_variables)
        local_ids = {id(v) for v in local.trainable_weights}
        for v, g, b in zip(model.trainable_variables, grads, before):
            step = g / SIZE if id(v) in local_ids else np.mean(hvd.allgather_object(g), axis=0)
            assert_close(v.numpy(), b - step, rtol=1e-5, atol=1e-6)
        shared = hvd.allgather_object(model.layers[0].kernel.numpy())
        np.testing.assert_array_equal(shared[0], shared[1])
        assert not np.allclose(*hvd.allgather_object(local.kernel.numpy()))


def test_broadcast_callback_keeps_local_variables():
    model = dense_model(0, keras.initializers.Constant(float(RANK)))
    for layer in model.layers:
        layer.trainable = False
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    local = list(model.layers[0].variables)
    model.fit(np.ones((2, 3)), np.ones((2, 2)), epochs=1, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(
                  1, local_variables=local)])
    local_ids = {id(v) for v in local}
    for v in model.variables:
        want = float(RANK) if id(v) in local_ids else 1.0
        assert_close(v.numpy(), np.full(v.shape, want))
    expect(ValueError, lambda: hvd_keras.callbacks.BroadcastGlobalVariablesCallback(
        0, local_variables=[np.ones(2)]), "variables")


def test_sync_batch_normalization():
    """Batches of 2 and 4 samples: outputs, moving statistics and input gradients are those of
    plain batch normalization over the 6 samples together."""
    rng = np.random.RandomState(0)
    everything = rng.rand(6, 3).astype("float32") * [1.0, 5.0, 10.0]
    mine = everything[:2] if RANK == 0 else everything[2:]
    weights = rng.rand(6, 3).astype("float32")
    my_weights = weights[:2] if RANK == 0 else weights[2:]
    sync, plain = hvd.SyncBatchNormalization(momentum=0.5), keras.layers.BatchNormalization(
        momentum=0.5)
    assert hvd_keras.SyncBatchNormalization is hvd.SyncBatchNormalization

    x, x_all = tf.constant(mine), tf.constant(everything)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = sync(x, training=True)
        loss = tf.reduce_sum(out * my_weights)
    grad = tape.gradient(loss, x)
    with tf.GradientTape() as tape:
        tape.watch(x_all)
        out_all = plain(x_all, training=True)
        loss_all = tf.reduce_sum(out_all * weights)
    grad_all = tape.gradient(loss_all, x_all)
    rows = slice(0, 2) if RANK == 0 else slice(2, 6)
    assert_close(out, out_all.numpy()[rows], rtol=1e-4, atol=1e-5)
    assert_close(grad, grad_all.numpy()[rows], rtol=1e-3, atol=1e-4)
    assert_close(sync.moving_mean, plain.moving_mean, rtol=1e-5)
    assert_close(sync.moving_variance, plain.moving_variance, rtol=1e-4)
    # Inference uses the moving statistics, no collective.
    assert_close(sync(x, training=False), plain(x, training=False), rtol=1e-5)
    # In model.fit (a tf.function) both ranks keep equal statistics.
    model = keras.Sequential([keras.Input((3,)), hvd.SyncBatchNormalization(),
                              keras.layers.Dense(1)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(mine, mine[:, :1], batch_size=len(mine), epochs=2, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    means = hvd.allgather_object(model.layers[0].moving_mean.numpy())
    np.testing.assert_allclose(means[0], means[1], rtol=1e-6)
