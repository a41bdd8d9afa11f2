"""hpc_horovod.torch over real MPI processes (2 and 3 ranks). The checks run in worker scripts,
one mpirun per group of checks (each launch with torch costs seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
WORKERS = Path(__file__).parent / "workers"
pytestmark = pytest.mark.mpi


def assert_every_rank_says(proc, ranks: int, text: str) -> None:
    output = proc.stdout + proc.stderr
    for rank in range(ranks):
        assert f"rank {rank}: {text}" in output, output


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_op_dtype_gradient_and_error(mpirun, ranks):
    """Every op on every dtype against values computed locally, in place without copies,
    async handles, grouped ops, sparse allreduce, the autograd rules, process sets with global
    root ranks, join and barrier, and the errors (non-contiguous in-place, bad dtypes, shape
    mismatches on every rank)."""
    proc = mpirun(ranks, WORKERS / "ops_worker.py", timeout=150)
    assert_every_rank_says(proc, ranks, "torch ops ok")


@pytest.mark.parametrize("ranks", [2, 3])
def test_optimizer_matches_one_process_on_the_whole_batch(mpirun, ranks):
    """DistributedOptimizer (SGD+momentum, Adam, backward_passes_per_step=2, fp16 compression,
    predivide, groups, Sum, sparse gradients, missing gradients, Adasum) reaches the parameters
    of one process on the concatenated batch and leaves bit-identical parameters on every rank;
    broadcast_optimizer_state, broadcast_object, allgather_object and SyncBatchNorm against
    torch's BatchNorm on the whole batch; Horovod's error texts."""
    proc = mpirun(ranks, WORKERS / "optimizer_worker.py", timeout=150)
    assert_every_rank_says(proc, ranks, "torch optimizer ok")


@pytest.mark.parametrize("ranks", [2, 3])
def test_what_horovods_torch_suite_expects(mpirun, ranks):
    """The behaviour Horovod's torch test suite checks: RuntimeError for tensors that differ
    between ranks, ValueError for a rank's own bad arguments and pending names, async handles
    that poll, callable sparse allreduce handles, scaled grouped reducescatter, join with
    allreduce, barriers and objects on process sets, and DistributedOptimizer with every torch
    optimizer (state broadcasts, rank-specific options, gradients missing on a rank, switching
    requires_grad, clipping, sparse embeddings, a process set), then a re-init."""
    proc = mpirun(ranks, WORKERS / "horovod_suite_worker.py", timeout=240,
                  env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert_every_rank_says(proc, ranks, "horovod suite ok")
