"""hpc_horovod.tensorflow over real MPI processes (2 ranks). The checks run in worker scripts,
one mpirun per group of checks: each process imports TensorFlow (about 5 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
WORKERS = Path(__file__).parent / "workers"
pytestmark = pytest.mark.mpi
# One intra- and one inter-op thread per rank keep two ranks on two cores; a rank that stops
# submitting makes the others fail within a minute instead of at the timeout.
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}


def assert_every_rank_says(proc, text: str) -> None:
    output = proc.stdout + proc.stderr
    for rank in range(2):
        assert f"rank {rank}: {text}" in output, output


def test_every_collective_eager_and_in_tf_function(mpirun):
    """allreduce (ops, scale factors, dtypes, compression, deprecated average=), grouped
    allreduce as one graph op, allgather with different first dimensions, broadcast, alltoall
    with splits, reducescatter, IndexedSlices, barrier, join, the *_op queries, the gradients of
    every op, process sets, weighted_average, broadcast_variables, and the errors (bad dtype,
    XLA, mismatched shapes in both modes)."""
    proc = mpirun(2, WORKERS / "ops_worker.py", timeout=240,
                  env={**TF_ENV, "HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert_every_rank_says(proc, "ALL OK")


def test_training_equals_single_process_large_batch(mpirun, tmp_path):
    """DistributedGradientTape (sparse and dense gradients, groups, predivide) and the Keras 3
    DistributedOptimizer in model.fit (with backward_passes_per_step) train to the weights of
    one process on the global batch; the callbacks' contracts (broadcast, metric averaging,
    warm-up and schedule values with momentum correction), checkpoints on rank 0 only,
    load_model, and the errors."""
    proc = mpirun(2, WORKERS / "training_worker.py", tmp_path, timeout=300, env=TF_ENV)
    assert_every_rank_says(proc, "ALL OK")


def test_tf1_graphs_sessions_hook_and_optimizer(mpirun):
    proc = mpirun(2, WORKERS / "tf1_worker.py", timeout=240, env=TF_ENV)
    assert_every_rank_says(proc, "ALL OK")


def test_horovod_parity_graph_order_errors_and_keras_extras(mpirun):
    """Twenty independent collectives in one tf.compat.v1 Session.run (four inter-op threads) and
    in one tf.function, repeated; the order never runs a collective that needs another feed; the
    broadcast's gradient in a graph; FailedPrecondition/InvalidArgument/NotImplemented errors;
    uint16; grouped_reducescatter; broadcast_; integer IndexedSlices averaged to floats; the
    Keras API's tensors; PartialDistributedOptimizer; the broadcast callback's local variables;
    SyncBatchNormalization."""
    proc = mpirun(2, WORKERS / "parity_worker.py", timeout=240, env=TF_ENV)
    assert_every_rank_says(proc, "ALL OK")
