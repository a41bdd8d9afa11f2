"""Every collective of hpc_horovod.tensorflow on 2 ranks, eagerly and inside tf.function: values,
static shapes, one graph op per grouped call, gradients, graph-safe queries, errors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tensorflow as tf
from tf_setup import RANK, assert_close, hvd, in_both_modes

import hpc_horovod

R = float(RANK + 1)  # this rank's scale: 1 on rank 0, 2 on rank 1
SUM, MEAN = 3.0, 1.5  # R summed and averaged over the two ranks


@pytest.fixture(autouse=True)
def _job():
    hvd.init()  # a new engine after a check that stopped it


def pyfunc_ops(fn, *specs) -> list[str]:
    graph = tf.function(fn).get_concrete_function(*specs).graph
    return [op for op in graph.get_operations() if op.type == "PyFunc"]


def test_allreduce():
    base = tf.constant([[1.0, -2.0, 3.0]])
    variable = tf.Variable(base * R)
    out = in_both_modes(lambda: {
        "avg": hvd.allreduce(base * R),
        "sum": hvd.allreduce(base * R, op=hvd.Sum),
        "min": hvd.allreduce(base * R, op=hvd.Min),
        "max": hvd.allreduce(base * R, op=hvd.Max),
        "prod": hvd.allreduce(base * R, op=hvd.Product),
        "scaled": hvd.allreduce(base * R, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
        "f64": hvd.allreduce(tf.cast(base, tf.float64) * R),
        "f16": hvd.allreduce(tf.cast(base * R, tf.float16), op=hvd.Sum),
        "bf16": hvd.allreduce(tf.cast(base * R, tf.bfloat16), op=hvd.Sum),
        "i32": hvd.allreduce(tf.constant([3, 4], tf.int32) * (RANK + 1), op=hvd.Sum),
        "bool": hvd.allreduce(tf.constant([RANK == 0, True]), op=hvd.Min),
        "fp16 compression": hvd.allreduce(base * R, compression=hvd.Compression.fp16),
        "variable": hvd.allreduce(variable, op=hvd.Sum),
    })
    assert_close(out["avg"], base * MEAN)
    assert_close(out["sum"], base * SUM)
    assert_close(out["min"], [[1.0, -4.0, 3.0]])
    assert_close(out["max"], [[2.0, -2.0, 6.0]])
    assert_close(out["prod"], base * base * 2.0)
    assert_close(out["scaled"], base * SUM)
    assert out["f64"].dtype == np.float64 and out["f16"].dtype == np.float16
    assert_close(out["f16"].astype(np.float32), base * SUM)
    assert out["bf16"].dtype == tf.bfloat16.as_numpy_dtype
    assert_close(out["bf16"].astype(np.float32), base * SUM)
    assert_close(out["i32"], [9, 12])
    assert out["bool"].tolist() == [False, True]
    assert out["fp16 compression"].dtype == np.float32
    assert_close(out["fp16 compression"], base * MEAN)

    @tf.function
    def static_shapes(x):
        y = hvd.allreduce(x)
        assert y.shape == x.shape, y.shape
        return y
    assert_close(static_shapes(base * R), base * MEAN)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_close(hvd.allreduce(base * R, average=False), base * SUM)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)


def test_grouped_allreduce():
    tensors = lambda: [tf.fill([2, 2], R), tf.constant([R], tf.float64),  # noqa: E731
                       tf.constant([RANK + 1], tf.int64), tf.zeros([0]), tf.fill([5], R)]
    out = in_both_modes(lambda: hvd.grouped_allreduce(tensors(), op=hvd.Sum))
    assert_close(out[0], np.full([2, 2], SUM))
    assert out[1].dtype == np.float64 and out[2].tolist() == [3] and out[3].shape == (0,)
    ops = pyfunc_ops(lambda: hvd.grouped_allreduce(tensors()))
    assert len(ops) == 1, f"a grouped allreduce must be one graph op, got {len(ops)}"


def test_allgather():
    mine = lambda: tf.fill([RANK + 1, 3], R)  # noqa: E731
    out = in_both_modes(lambda: {
        "one": hvd.allgather(mine()),
        "scalar": hvd.allgather(tf.constant(R)),
        "group": hvd.grouped_allgather([mine(), tf.constant([RANK], tf.int32)]),
    })
    assert_close(out["one"], [[1.0] * 3, [2.0] * 3, [2.0] * 3])
    assert_close(out["scalar"], [1.0, 2.0])
    assert out["group"][1].tolist() == [0, 1]

    @tf.function
    def static_shape():
        y = hvd.allgather(mine())
        assert y.shape.as_list() == [None, 3], y.shape
        return y
    assert_close(static_shape(), out["one"])


def test_broadcast():
    out = in_both_modes(lambda: {"from1": hvd.broadcast(tf.fill([2, 3], R), root_rank=1),
                                 "from0": hvd.broadcast(tf.constant([RANK], tf.int32), 0)})
    assert_close(out["from1"], np.full([2, 3], 2.0))
    assert out["from0"].tolist() == [0]


def test_alltoall():
    data = lambda: tf.range(4) + 10 * RANK  # noqa: E731
    out = in_both_modes(lambda: {
        "equal": hvd.alltoall(data()),
        "split": hvd.alltoall(data(), splits=[1, 3] if RANK == 0 else [2, 2]),
    })
    expected = {0: [0, 1, 10, 11], 1: [2, 3, 12, 13]}[RANK]
    assert out["equal"].tolist() == expected
    received, received_splits = out["split"]
    expected = {0: ([0, 10, 11], [1, 2]), 1: ([1, 2, 3, 12, 13], [3, 2])}[RANK]
    assert (received.tolist(), received_splits.tolist()) == expected


def test_reducescatter():
    rows = lambda: tf.reshape(tf.range(6, dtype=tf.float32), [3, 2]) * R  # noqa: E731
    out = in_both_modes(lambda: {"sum": hvd.reducescatter(rows(), op=hvd.Sum),
                                 "avg": hvd.reducescatter(rows())})
    full = np.arange(6, dtype=np.float32).reshape(3, 2)
    mine = full[:2] if RANK == 0 else full[2:]  # uneven: rank 0 gets the extra row
    assert_close(out["sum"], mine * SUM)
    assert_close(out["avg"], mine * MEAN)

    @tf.function
    def static_shape():
        y = hvd.reducescatter(rows())
        assert y.shape.as_list() == [2 - RANK, 2], y.shape
        return y
    static_shape()


def test_sparse():
    def reduce():
        slices = tf.IndexedSlices(tf.fill([1, 2], R), tf.constant([RANK * 2]),
                                  dense_shape=tf.constant([4, 2]))
        return tf.convert_to_tensor(hvd.allreduce(slices))
    out = in_both_modes(reduce)
    assert_close(out, [[0.5, 0.5], [0, 0], [1.0, 1.0], [0, 0]])


def test_queries_barrier_join():
    out = in_both_modes(lambda: [hvd.size_op(), hvd.rank_op(), hvd.local_rank_op(),
                                 hvd.local_size_op(), hvd.process_set_included_op(),
                                 hvd.cross_size_op()])
    assert [int(v) for v in out] == [2, RANK, hvd.local_rank(), hvd.local_size(), 1,
                                     hvd.cross_size()]
    assert hvd.barrier() is None
    tf.function(lambda: (hvd.barrier(), None)[1])()
    # Rank 0 joins at once; rank 1 still reduces: rank 0 contributes zeros to its Sum.
    if RANK == 1:
        assert_close(hvd.allreduce(tf.constant([5.0]), op=hvd.Sum, name="alone"), [5.0])
    assert int(hvd.join()) == 1
    assert int(tf.function(hvd.join)()) in (0, 1)


def test_gradients():
    x = tf.Variable([1.0, 2.0, 3.0])

    def grads(fn):
        def run():
            with tf.GradientTape() as tape:
                y = fn(x * R)
                loss = tf.reduce_sum(y * tf.cast(tf.range(tf.size(y)) + 1, y.dtype))
            return tape.gradient(loss, x)
        return in_both_modes(run)

    weights = np.array([1.0, 2.0, 3.0])
    # allreduce: dL/dx = R * allreduce(dL/dy) with the same op.
    assert_close(grads(lambda t: hvd.allreduce(t, op=hvd.Sum)), R * 2 * weights)
    assert_close(grads(lambda t: hvd.allreduce(t)), R * weights)
    assert_close(grads(lambda t: hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum)[1]),
                 R * 4 * weights)
    # allgather: the gathered weights are 1..6; rank r's rows are 3r+1..3r+3 (Average: same on
    # both ranks, so the average is the value itself).
    assert_close(grads(hvd.allgather), R * (np.arange(3) + 1 + 3 * RANK))
    # broadcast from 1: the root gets the average of the gradients, the other rank zeros.
    assert_close(grads(lambda t: hvd.broadcast(t, 1)), R * weights * (RANK == 1))
    # alltoall: rank 0 receives [a0, b0], rank 1 [a1, b1] (weights 1, 2); the gradient goes back.
    expected = {0: [1.0, 1.0, 0.0], 1: [2.0, 2.0, 0.0]}[RANK]
    assert_close(grads(lambda t: hvd.alltoall(t[:2])), R * np.array(expected))
    # reducescatter Sum: gradient = allgather(dy) * size.
    assert_close(grads(lambda t: hvd.reducescatter(t, op=hvd.Sum)),
                 R * 2 * np.array([1.0, 2.0, 1.0]))
    with pytest.raises(ValueError, match="has no gradient"):
        grads(lambda t: hvd.allreduce(t, op=hvd.Max))


def test_strings_are_refused():
    with pytest.raises(ValueError, match="dtype string"):
        hvd.allreduce(tf.constant(["a"]))


def test_xla_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="jit_compile=False"):
        tf.function(hvd.allreduce, jit_compile=True)(tf.ones(2))


def test_mismatched_shapes_fail_eagerly():
    shape = [2] if RANK == 0 else [3]
    with pytest.raises(hpc_horovod.HorovodInternalError) as caught:
        hvd.allreduce(tf.ones(shape), name="mismatch")
    assert "mismatched allreduce tensor shapes" in str(caught.value).lower(), caught.value


def test_mismatched_shapes_fail_in_graph_mode():
    shape = [2] if RANK == 0 else [3]
    with pytest.raises(tf.errors.OpError) as caught:
        tf.function(lambda: hvd.allreduce(tf.ones(shape), name="mismatch.graph"))()
    assert "mismatched allreduce tensor shapes" in str(caught.value).lower(), caught.value


def test_broadcast_global_variables_is_for_graph_mode():
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)


def test_functions():
    v = tf.Variable(tf.fill([3], R))
    hvd.broadcast_variables([v], root_rank=1)
    assert_close(v, [2.0, 2.0, 2.0])
    w = tf.Variable(tf.fill([2], R))
    tf.function(lambda: (hvd.broadcast_variables([w], root_rank=0), None)[1])()
    assert_close(w, [1.0, 1.0])
    assert hvd.broadcast_object({"rank": RANK}, root_rank=1) == {"rank": 1}
    assert hvd.allgather_object(RANK * 10) == [0, 10]
    # Shards of 3 and 7 samples with accuracies 1.0 and 0.5: the whole set's accuracy is 0.65.
    count = 3 if RANK == 0 else 7
    out = in_both_modes(lambda: hvd.weighted_average({"acc": 1.0 - 0.5 * RANK,
                                                      "v": tf.fill([2], R)}, count))
    assert_close(out["acc"], (3 * 1.0 + 7 * 0.5) / 10)
    assert_close(out["v"], [(3 + 14) / 10] * 2)


def test_process_set():
    only1 = hvd.ProcessSet([1])
    hvd.add_process_set(only1)
    assert int(hvd.process_set_included_op(only1.process_set_id)) == RANK
    if RANK == 1:
        assert int(hvd.size_op(only1.process_set_id)) == 1
        out = in_both_modes(lambda: hvd.allreduce(tf.constant([4.0]), process_set=only1))
        assert_close(out, [4.0])
    hvd.barrier()


def test_auto_names_interleave():
    """Two functions whose collectives get the same automatic names run one after the other."""
    f = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum))
    g = tf.function(lambda x: hvd.allreduce(x * 2, op=hvd.Sum))
    for _ in range(3):
        assert_close(f(tf.ones(2)), [2.0, 2.0])
        assert_close(g(tf.ones(2)), [4.0, 4.0])
