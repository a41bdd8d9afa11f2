"""Collectives of one tf.compat.v1 graph built and fetched one at a time, on 2 and 3 ranks (the
checks expect no particular size): in-place broadcasts of variables in the shape of Horovod's
``test_horovod_broadcast_inplace_cpu`` in graph mode, and the build-order rule that keeps the
ranks in step (see hpc_horovod.tensorflow.mpi_ops).

Fetching a collective must run that collective alone: one that ran earlier is no longer run again
for those built after it, so a graph that gains a collective per fetch costs one collective per
fetch, not one per collective built so far."""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402
from tensorflow.python.ops import ref_variable, resource_variable_ops  # noqa: E402

import hpc_horovod.tensorflow as hvd  # noqa: E402
from hpc_horovod.common import ops as core  # noqa: E402

tf.disable_eager_execution()
tf.get_logger().setLevel("ERROR")
# one inter-op thread: a graph whose collectives the ranks ran in different orders would hang
ONE_THREAD = tf.ConfigProto(inter_op_parallelism_threads=1, intra_op_parallelism_threads=1)


@pytest.fixture(autouse=True)
def _job():
    hvd.init()  # a new engine after a check that stopped it


@pytest.fixture
def submissions(monkeypatch) -> list:
    """The engine submissions made by broadcasts from now on (one list entry each)."""
    made = []
    submit = core.submit

    def counting(requests):
        made.append(len(requests))
        return submit(requests)
    monkeypatch.setattr(core, "submit", counting)
    return made


def collective(tensor: tf.Tensor) -> tf.Operation:
    """The graph op of the collective whose output ``tensor`` is (custom_gradient wraps it)."""
    while tensor.op.type != "PyFunc":
        tensor = tensor.op.inputs[0]
    return tensor.op


def test_inplace_broadcasts_fetched_one_at_a_time(submissions):
    rank, size = hvd.rank(), hvd.size()
    dtypes = [tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64, tf.bool]
    with tf.Graph().as_default(), tf.Session(config=ONE_THREAD) as sess:
        for make, dtype, dim, root in itertools.product(
                [ref_variable.RefVariable, resource_variable_ops.ResourceVariable], dtypes,
                [1, 2, 3], range(size)):
            ones = tf.ones([17] * dim)
            var = make(tf.cast(ones * rank % 2 if dtype == tf.bool else ones * rank, dtype))
            sess.run(tf.global_variables_initializer())
            (value,) = hvd.broadcast_([var], root)
            before = len(submissions)
            got = sess.run(value)
            assert len(submissions) == before + 1, (
                f"fetching the broadcast of {var.name} ran {len(submissions) - before} "
                "broadcasts: the earlier ones ran again")
            expected = root % 2 if dtype == tf.bool else root
            np.testing.assert_array_equal(got.astype(np.int32), np.full([17] * dim, expected))
            np.testing.assert_array_equal(sess.run(var), got)


def test_build_order_until_run(submissions):
    """Collectives built before any of them ran are chained in build order (fetched together,
    they run in one order on every rank); one that already ran is no longer a predecessor."""
    rank = hvd.rank()
    with tf.Graph().as_default(), tf.Session(config=ONE_THREAD) as sess:
        variables = [tf.Variable(float(rank + i)) for i in range(4)]
        sess.run(tf.global_variables_initializer())
        first = [hvd.broadcast(v, root_rank=0) for v in variables[:3]]
        for earlier, later in zip(first, first[1:]):
            assert collective(earlier) in collective(later).control_inputs
        assert sess.run(first) == [0.0, 1.0, 2.0]
        assert len(submissions) == 3
        last = hvd.broadcast(variables[3], root_rank=0)
        assert not collective(last).control_inputs
        assert sess.run(last) == 3.0
        assert len(submissions) == 4
