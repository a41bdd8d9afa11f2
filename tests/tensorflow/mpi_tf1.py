"""TF1-style graphs and sessions (tf.compat.v1, eager execution off) on 2 ranks: collectives run
by Session.run, broadcast_global_variables and its hook, the wrapped tf.compat.v1 optimizer."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from tf_setup import RANK, assert_close, hvd

tf.disable_eager_execution()
R = float(RANK + 1)


@pytest.fixture(autouse=True)
def _job():
    hvd.init()  # a new engine after a check that stopped it


def test_ops_in_session():
    x = tf.placeholder(tf.float32, [None])
    reduced = hvd.allreduce(x, op=hvd.Sum)
    gathered = hvd.allgather(x)
    root = hvd.broadcast(x, root_rank=1)
    grad = tf.gradients(tf.reduce_sum(hvd.allreduce(x * 2.0)), x)[0]
    queries = [hvd.size_op(), hvd.rank_op()]
    with tf.Session() as sess:
        for n in (2, 3):  # the graph's ops run again, under the same names
            feed = {x: np.full(n, R, np.float32)}
            out = sess.run([reduced, gathered, root, grad] + queries, feed)
            assert_close(out[0], [3.0] * n)
            assert_close(out[1], [1.0] * n + [2.0] * n)
            assert_close(out[2], [2.0] * n)
            assert_close(out[3], [2.0] * n)
            assert out[4:] == [2, RANK]


def test_broadcast_global_variables_and_optimizer():
    with tf.Graph().as_default():
        v = tf.get_variable("v", initializer=tf.constant([R, 10.0 * R]))
        step = tf.train.get_or_create_global_step()
        loss = tf.reduce_sum(v * R)  # gradient: R, averaged over ranks: 1.5
        opt = hvd.DistributedOptimizer(tf.train.GradientDescentOptimizer(1.0))
        grads_and_vars = opt.compute_gradients(loss)
        train = opt.apply_gradients(grads_and_vars, global_step=step)
        bcast = hvd.broadcast_global_variables(0)
        with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(bcast)
            assert_close(sess.run(v), [1.0, 10.0])
            assert_close(sess.run(grads_and_vars[0][0]), [1.5, 1.5])
            sess.run(train)
            assert_close(sess.run(v), [-0.5, 8.5])
            assert sess.run(step) == 1


def test_hook_in_monitored_session():
    with tf.Graph().as_default():
        v = tf.get_variable("w", initializer=tf.constant([R, R]))
        tf.train.get_or_create_global_step()
        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        with tf.train.MonitoredTrainingSession(hooks=hooks) as sess:
            assert_close(sess.run(v), [1.0, 1.0])
