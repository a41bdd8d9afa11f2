"""Shared start of the TensorFlow check modules (``mpi_*.py``): quiet logs, one thread per pool
(two ranks share two cores), hpc_horovod initialised, and a helper running a check eagerly and in
tf.function."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")  # retracing notices of the checks that trace on purpose
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import hpc_horovod.tensorflow as hvd  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
# the checks' expected values are those of 2 ranks (a process alone only collects the checks)
assert SIZE in (1, 2), f"the TensorFlow checks run on 2 ranks, not {SIZE}"


def in_both_modes(check):
    """Run ``check()`` eagerly, then traced by tf.function; compare the results and return them.

    ``check`` returns a (nested) structure of tensors.
    """
    eager = tf.nest.map_structure(np.asarray, check())
    graph = tf.nest.map_structure(np.asarray, tf.function(check)())
    tf.nest.map_structure(np.testing.assert_allclose, eager, graph)
    return eager


def assert_close(actual, expected, **kw):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), **kw)
