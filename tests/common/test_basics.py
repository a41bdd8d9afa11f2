"""``hpc_horovod.common.basics`` in one process, without MPI: what every call says before
``init`` and after ``shutdown``, init/shutdown/init, the queries of a job of size 1, one-task and
multi-task batch jobs, and submissions racing a shutdown."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from support import leave_launchers

import hpc_horovod as hvd
from hpc_horovod.common import basics, request
from hpc_horovod.common.errors import NOT_INITIALIZED, HorovodInternalError

# -- before init, after shutdown ------------------------------------------------------------------
BEFORE_INIT = {
    "size": hvd.size, "rank": hvd.rank, "local_rank": hvd.local_rank,
    "local_size": hvd.local_size, "cross_rank": hvd.cross_rank, "cross_size": hvd.cross_size,
    "is_homogeneous": hvd.is_homogeneous, "mpi_enabled": hvd.mpi_enabled,
    "mpi_threads_supported": hvd.mpi_threads_supported, "barrier": hvd.barrier,
    "join": hvd.join, "stop_timeline": hvd.stop_timeline,
    "global_set_size": hvd.global_process_set.size,
    "global_set_rank": hvd.global_process_set.rank,
    "allreduce": lambda: hvd.allreduce(np.ones(2)),
    "allreduce_async": lambda: hvd.allreduce_async(np.ones(2), name="x"),
    "grouped_allreduce": lambda: hvd.grouped_allreduce([np.ones(2)]),
    "allgather": lambda: hvd.allgather(np.ones(2)),
    "broadcast": lambda: hvd.broadcast(np.ones(2), 0),
    "alltoall": lambda: hvd.alltoall(np.ones(2)),
    "reducescatter": lambda: hvd.reducescatter(np.ones(2)),
    "broadcast_object": lambda: hvd.broadcast_object({"a": 1}),
    "allgather_object": lambda: hvd.allgather_object(1),
    "poll": lambda: hvd.poll(0),
    "synchronize": lambda: hvd.synchronize(0),
    "start_timeline": lambda: hvd.start_timeline("/tmp/never.json"),
    "add_process_set": lambda: hvd.add_process_set([0]),
}


@pytest.mark.parametrize("call", BEFORE_INIT.values(), ids=BEFORE_INIT.keys())
def test_calls_before_init_raise_horovods_error(call):
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value) == "Horovod has not been initialized; use hvd.init()." \
        == NOT_INITIALIZED


SYNCHRONOUS = {
    "allreduce": lambda: hvd.allreduce(np.ones(2)),
    "allreduce_": lambda: hvd.allreduce_(np.ones(2)),
    "grouped_allreduce": lambda: hvd.grouped_allreduce([np.ones(2), np.ones(3)]),
    "allgather": lambda: hvd.allgather(np.ones(2)),
    "grouped_allgather": lambda: hvd.grouped_allgather([np.ones(2)]),
    "broadcast": lambda: hvd.broadcast(np.ones(2), 0),
    "broadcast_": lambda: hvd.broadcast_(np.ones(2), 0),
    "alltoall": lambda: hvd.alltoall(np.ones(2)),
    "reducescatter": lambda: hvd.reducescatter(np.ones(2)),
    "grouped_reducescatter": lambda: hvd.grouped_reducescatter([np.ones(2)]),
    "barrier": hvd.barrier,
    "join": hvd.join,
    "broadcast_object": lambda: hvd.broadcast_object({"a": 1}),
    "allgather_object": lambda: hvd.allgather_object(1),
}


@pytest.mark.parametrize("call", SYNCHRONOUS.values(), ids=SYNCHRONOUS.keys())
def test_synchronous_ops_run_their_own_cycles(leaves_engine_asleep, call):
    """They wait for what they submit, so they leave the engine thread asleep."""
    leaves_engine_asleep(call, lambda: hvd.allreduce_async(np.ones(2)))


def test_build_queries_need_no_init():
    hvd.shutdown()
    assert isinstance(hvd.mpi_built(), bool)
    assert isinstance(hvd.nccl_built(), int) and not isinstance(hvd.nccl_built(), bool)
    assert isinstance(hvd.cuda_built(), bool)
    assert hvd.gloo_built() is False and hvd.gloo_enabled() is False
    assert hvd.rocm_built() is False and hvd.ddl_built() is False and hvd.ccl_built() is False


def test_init_shutdown_init_again(single):
    assert single.is_initialized()
    assert single.allreduce(np.ones(2), name="same").tolist() == [1.0, 1.0]
    single.shutdown()
    assert not single.is_initialized()
    with pytest.raises(ValueError, match="not been initialized"):
        single.allreduce(np.ones(2))
    single.shutdown()  # a second shutdown is harmless
    single.init()
    single.init()  # idempotent
    # names and automatic counters start afresh
    assert single.allreduce(np.ones(2), name="same").tolist() == [1.0, 1.0]
    assert single.size() == 1


def test_queries(single):
    assert (single.size(), single.rank()) == (1, 0)
    assert (single.local_size(), single.local_rank()) == (1, 0)
    assert (single.cross_size(), single.cross_rank()) == (1, 0)
    assert single.is_homogeneous()
    assert single.mpi_enabled() is False and single.mpi_threads_supported() is False
    assert single.global_process_set.size() == 1 and single.global_process_set.rank() == 0
    assert single.global_process_set.included()


def test_one_task_batch_job_runs_single(monkeypatch):
    hvd.shutdown()
    leave_launchers(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    try:
        hvd.init()
        assert hvd.size() == 1 and not hvd.mpi_enabled()
    finally:
        hvd.shutdown()


def test_multi_task_batch_script_refuses_to_init(monkeypatch):
    hvd.shutdown()
    leave_launchers(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "0")
    with pytest.raises(hvd.TopologyError, match="srun python train.py"):
        hvd.init()
    assert not hvd.is_initialized()


def test_submissions_racing_a_shutdown_all_complete(single):
    """Submission takes no lock: a request enqueued while the engine stops must still be
    completed (with the shutdown error), never left pending."""
    engine = basics.engine()
    x = np.ones(4, np.float32)
    accepted, refused = [], []
    go = threading.Event()

    def submit_until_refused(t: int) -> None:
        go.wait()
        for i in range(100_000):
            try:
                req = request.allreduce_request(x, name=f"race.{t}.{i}", op=hvd.Sum)
                handle = engine.submit(req)
            except ValueError:
                refused.append(t)
                return
            accepted.append(engine.request(handle))

    threads = [threading.Thread(target=submit_until_refused, args=(t,)) for t in range(3)]
    for thread in threads:
        thread.start()
    go.set()
    time.sleep(0.05)
    hvd.shutdown()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(refused) == [0, 1, 2] and accepted
    pending = [req.name for req in accepted if not req.done]
    assert not pending, f"{len(pending)} requests never completed, e.g. {pending[:3]}"
    ok = [req for req in accepted if req.error is None]
    assert ok and all(req.result is not None for req in ok)
    # The narrow case, forced: a submitter that passed the "still running" check, then lost the
    # GIL until the engine had stopped and drained its queue.
    hvd.init()
    engine = basics.engine()
    engine.on_submit = hvd.shutdown
    late = request.allreduce_request(x, name="late", op=hvd.Sum)
    engine.submit(late)
    assert engine.stopped
    assert late.done and isinstance(late.error, HorovodInternalError)
