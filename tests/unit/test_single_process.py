"""The whole numpy API in one process, without MPI: what a laptop, a notebook or a one-task batch
job runs. Every collective of a job of size 1 is the identity (times the scale factors)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from support import clean_env, leave_launchers, single_process_job

import hpc_horovod as hvd
from hpc_horovod.common import basics, ops
from hpc_horovod.common.errors import NOT_INITIALIZED, HorovodInternalError
from hpc_horovod.common.types import SUPPORTED_DTYPES, bfloat16

ROOT = Path(__file__).resolve().parents[2]
NUMERIC = [d for d in SUPPORTED_DTYPES if d != np.bool_]


@pytest.fixture
def single(monkeypatch):
    with single_process_job(hvd, monkeypatch) as job:
        yield job


def values(dtype, shape=(3, 4)) -> np.ndarray:
    return (np.arange(int(np.prod(shape))) % 7 + 1).reshape(shape).astype(dtype)


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


# -- allreduce ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", NUMERIC, ids=str)
@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product])
def test_allreduce_every_dtype_and_op_is_the_identity(single, dtype, op):
    x = values(dtype)
    out = single.allreduce(x, op=op)
    assert out.dtype == x.dtype and out.shape == x.shape
    np.testing.assert_array_equal(out, x)
    assert not np.shares_memory(out, x)


@pytest.mark.parametrize("op", [hvd.Min, hvd.Max])
def test_allreduce_bool_min_max(single, op):
    x = np.array([True, False, True])
    out = single.allreduce(x, op=op)
    assert out.dtype == np.bool_ and out.tolist() == x.tolist()


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32, np.float64], ids=str)
def test_allreduce_prescale_postscale(single, dtype):
    x = values(dtype)
    out = single.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
    assert out.dtype == x.dtype
    np.testing.assert_allclose(out.astype(np.float64), x.astype(np.float64) * 2.0, rtol=1e-2)
    out = single.allreduce(x, op=hvd.Max, prescale_factor=3.0)
    np.testing.assert_allclose(out.astype(np.float64), x.astype(np.float64) * 3.0, rtol=1e-2)


def test_allreduce_integer_scaling_truncates_like_a_cast(single):
    out = single.allreduce(np.array([1, 2, 3], np.int32), op=hvd.Sum, prescale_factor=2.5)
    assert out.dtype == np.int32 and out.tolist() == [2, 5, 7]


def test_allreduce_default_op_is_average_and_average_is_deprecated(single):
    x = np.array([2.0, 4.0])
    np.testing.assert_array_equal(single.allreduce(x), x)
    with pytest.warns(DeprecationWarning, match="replaced with `op`"):
        np.testing.assert_array_equal(single.allreduce(x, average=True), x)
    with pytest.warns(DeprecationWarning):
        np.testing.assert_array_equal(single.allreduce(x, average=False), x)
    with pytest.raises(ValueError, match="The op parameter supersedes average"):
        single.allreduce(x, average=True, op=hvd.Sum)


def test_allreduce_accepts_lists_scalars_and_strided_views(single):
    assert single.allreduce([1.0, 2.0], op=hvd.Sum).tolist() == [1.0, 2.0]
    assert single.allreduce(np.float32(3.0), op=hvd.Sum).shape == ()
    base = np.arange(12.0).reshape(3, 4)
    view = base[:, ::2]
    np.testing.assert_array_equal(single.allreduce(view, op=hvd.Sum), view)


def test_allreduce_in_place(single):
    x = np.array([1.0, 2.0, 3.0], np.float32)
    out = single.allreduce_(x, op=hvd.Sum, prescale_factor=2.0)
    assert out is x and x.tolist() == [2.0, 4.0, 6.0]
    h = single.allreduce_async_(x, op=hvd.Average)
    assert single.synchronize(h) is x
    y = np.arange(6, dtype=np.float16)
    assert single.allreduce_(y, op=hvd.Sum, postscale_factor=0.5) is y
    assert y.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]


@pytest.mark.parametrize("bad", [np.arange(6.0)[::2], np.asfortranarray(np.ones((2, 3))),
                                 [1.0, 2.0]], ids=["strided", "fortran", "list"])
def test_allreduce_in_place_needs_a_contiguous_array(single, bad):
    with pytest.raises(ValueError, match="in-place allreduce needs a writable C-contiguous"):
        single.allreduce_(bad)


def test_allreduce_in_place_refuses_read_only(single):
    x = np.ones(3)
    x.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        single.allreduce_(x)


def test_adasum_of_one_rank_is_the_identity(single):
    x = np.array([1.0, -2.0, 3.0], np.float32)
    np.testing.assert_allclose(single.allreduce(x, op=hvd.Adasum), x)


def test_grouped_allreduce(single):
    xs = [values(np.float32, (2,)), values(np.float64, (3, 2)), values(np.int32, (5,))]
    outs = single.grouped_allreduce(xs, op=hvd.Sum, name="g")
    for x, out in zip(xs, outs):
        assert out.dtype == x.dtype
        np.testing.assert_array_equal(out, x)
    handles = single.grouped_allreduce_async(xs, op=hvd.Sum)
    assert len(handles) == 3 and len(set(handles)) == 3
    assert all(single.synchronize(h) is not None for h in handles)


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("array", [np.ones(2, np.complex64), np.array(["a"]), np.array([{}]),
                                   np.ones(2, np.uint16), np.ones(2, np.uint64)], ids=str)
@pytest.mark.parametrize("call", [
    lambda a: hvd.allreduce(a, op=hvd.Sum), lambda a: hvd.allgather(a),
    lambda a: hvd.broadcast(a, 0), lambda a: hvd.alltoall(a),
    lambda a: hvd.reducescatter(a, op=hvd.Sum)])
def test_unsupported_dtype_is_a_value_error_listing_the_supported(single, array, call):
    with pytest.raises(ValueError) as info:
        call(array)
    assert f"does not support dtype {array.dtype}" in str(info.value)
    assert "float32" in str(info.value) and "bfloat16" in str(info.value)


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Product])
def test_bool_allreduce_needs_min_or_max(single, op):
    with pytest.raises(ValueError, match="supports only op=Min .* and op=Max"):
        single.allreduce(np.array([True]), op=op)


def test_bool_reducescatter_default_average_is_refused(single):
    with pytest.raises(ValueError, match="op=Min"):
        single.reducescatter(np.array([True, False]))


def test_adasum_needs_floating_point(single):
    with pytest.raises(ValueError, match="Adasum needs floating point tensors, not int32"):
        single.allreduce(np.ones(2, np.int32), op=hvd.Adasum)


def test_reducescatter_refuses_adasum_and_scalars(single):
    with pytest.raises(ValueError, match="does not support Adasum"):
        single.reducescatter(np.ones(2), op=hvd.Adasum)
    with pytest.raises(ValueError, match="at least one dimension"):
        single.reducescatter(np.float32(1.0))


@pytest.mark.parametrize("op", [7, -1, "sum"])
def test_unknown_op(single, op):
    with pytest.raises(ValueError, match="unknown reduction op"):
        single.allreduce(np.ones(2), op=op)


def test_duplicate_name_in_flight_is_a_value_error(single):
    engine = basics.engine()
    # No cycle runs, so the first request cannot complete before the second arrives: the
    # real-life case is a peer that has not submitted yet (tests/parallel).
    with engine.paused():
        first = single.allreduce_async(np.ones(2), name="grad")
        with pytest.raises(ValueError) as info:
            single.allreduce_async(np.ones(2), name="grad")
    assert "same name as another tensor that is currently being processed" in str(info.value)
    assert "[grad]" in str(info.value)
    np.testing.assert_array_equal(single.synchronize(first), np.ones(2))
    # once done, the name is free again
    single.synchronize(single.allreduce_async(np.ones(2), name="grad"))


def test_duplicate_name_within_one_submission_is_a_value_error(single):
    with pytest.raises(ValueError, match="same name"):
        ops.submit([ops.allreduce_request(np.ones(2), name="x"),
                    ops.allreduce_request(np.zeros(2), name="x")])


def test_handles(single):
    h = single.allreduce_async(np.ones(2), name="h")
    out = single.synchronize(h)
    np.testing.assert_array_equal(out, np.ones(2))
    with pytest.raises(ValueError, match=f"handle {h} was not created or has been cleared"):
        single.poll(h)
    with pytest.raises(ValueError, match="was not created"):
        single.synchronize(12345)
    h = single.allgather_async(np.ones(2))
    while not single.poll(h):
        pass
    assert single.synchronize(h).shape == (2,)


# -- the other collectives ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_allgather_broadcast_alltoall_every_dtype(single, dtype):
    x = values(dtype, (4, 3))
    gathered = single.allgather(x)
    np.testing.assert_array_equal(gathered, x)
    assert gathered.dtype == x.dtype
    out = single.broadcast(x, root_rank=0)
    np.testing.assert_array_equal(out, x)
    assert not np.shares_memory(out, x)
    received, splits = single.alltoall(x)
    np.testing.assert_array_equal(received, x)
    assert splits.tolist() == [4]


def test_allgather_of_a_scalar_is_a_vector(single):
    assert single.allgather(np.float64(2.5)).tolist() == [2.5]


def test_grouped_allgather(single):
    outs = single.grouped_allgather([np.ones((2, 2)), np.zeros(3, np.int8)])
    assert [o.shape for o in outs] == [(2, 2), (3,)]


def test_broadcast_in_place(single):
    x = np.arange(4.0)
    assert single.broadcast_(x, 0) is x
    with pytest.raises(ValueError, match="C-contiguous"):
        single.broadcast_(np.arange(8.0)[::2], 0)
    read_only = np.ones(3)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="needs a writable C-contiguous numpy array"):
        single.broadcast_(read_only, 0)


@pytest.mark.parametrize("root", [1, -1])
def test_broadcast_root_must_be_a_member(single, root):
    with pytest.raises(ValueError, match=f"root rank {root} is not a member"):
        single.broadcast(np.ones(2), root_rank=root)


def test_alltoall_with_splits(single):
    x = np.arange(10.0).reshape(5, 2)
    received, splits = single.alltoall(x, splits=[5])
    np.testing.assert_array_equal(received, x)
    assert splits.tolist() == [5]
    empty = np.empty((0, 2))
    received, splits = single.alltoall(empty, splits=np.array([0]))
    assert received.shape == (0, 2) and splits.tolist() == [0]


@pytest.mark.parametrize("splits,fragment", [
    ([2, 3], "splits has 2 entries but the process set has 1 ranks"),
    ([4], "must be non-negative and sum to the first dimension 5"),
    ([-1], "must be non-negative"),
])
def test_alltoall_splits_validation(single, splits, fragment):
    with pytest.raises(ValueError) as info:
        single.alltoall(np.ones((5, 2)), splits=splits)
    assert fragment in str(info.value)


@pytest.mark.parametrize("dtype", NUMERIC, ids=str)
def test_reducescatter(single, dtype):
    x = values(dtype, (5, 2))
    out = single.reducescatter(x, op=hvd.Sum)
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(out, x)


def test_reducescatter_average_and_scales(single):
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_allclose(single.reducescatter(x), x)
    np.testing.assert_allclose(single.reducescatter(x, op=hvd.Sum, prescale_factor=2.0,
                                                    postscale_factor=0.25), x * 0.5)
    outs = single.grouped_reducescatter([x, x[:3].astype(np.float64)], op=hvd.Sum)
    assert [o.dtype for o in outs] == [np.float32, np.float64]


def test_barrier_join_and_objects(single):
    single.barrier()
    assert single.join() == 0
    obj = {"epoch": 3, "lr": [0.1, 0.01], "f": lambda v: v + 1}
    got = single.broadcast_object(obj, root_rank=0)
    assert got["epoch"] == 3 and got["f"](1) == 2
    assert single.allgather_object(("rank", 0)) == [("rank", 0)]
    assert single.broadcast_object(None) is None


def test_allreduce_after_join_still_works(single):
    assert single.join() == 0
    np.testing.assert_array_equal(single.allreduce(np.ones(2), op=hvd.Sum), np.ones(2))


def test_many_unnamed_ops_in_flight(single):
    handles = [single.allreduce_async(np.full(3, i, np.float32), op=hvd.Sum) for i in range(50)]
    for i, h in enumerate(handles):
        np.testing.assert_array_equal(single.synchronize(h), np.full(3, i, np.float32))


# -- process sets ---------------------------------------------------------------------------------
def test_static_process_set(monkeypatch):
    hvd.shutdown()
    leave_launchers(monkeypatch)
    ps = hvd.ProcessSet([0])
    hvd.init(process_sets=[ps])
    try:
        assert ps.process_set_id == 1 and ps.size() == 1 and ps.rank() == 0 and ps.included()
        np.testing.assert_array_equal(hvd.allreduce(np.ones(2), process_set=ps), np.ones(2))
        assert hvd.broadcast(np.ones(2), 0, process_set=ps).tolist() == [1.0, 1.0]
        with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1"):
            hvd.add_process_set([0])
    finally:
        hvd.shutdown()
    assert ps.process_set_id is None
    with pytest.raises(ValueError, match="was not registered"):
        ps.size()


def test_process_set_validation(monkeypatch):
    with pytest.raises(ValueError, match="distinct ranks"):
        hvd.ProcessSet([0, 0])
    with pytest.raises(ValueError, match="distinct ranks"):
        hvd.ProcessSet([])
    hvd.shutdown()
    leave_launchers(monkeypatch)
    with pytest.raises(ValueError, match=r"ranks \[3\] are outside the job of size 1"):
        hvd.init(process_sets=[hvd.ProcessSet([0, 3])])
    hvd.shutdown()


def test_dynamic_process_sets(monkeypatch):
    hvd.shutdown()
    leave_launchers(monkeypatch)
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    hvd.init()
    try:
        ps = hvd.add_process_set([0])
        assert ps.process_set_id is not None and ps.size() == 1
        assert hvd.allgather(np.ones(1), process_set=ps).tolist() == [1.0]
        with pytest.raises(ValueError, match="already exists"):
            hvd.add_process_set([0])
        assert hvd.remove_process_set(ps) is True
        assert ps.process_set_id is None
        assert hvd.remove_process_set(ps) is False
        assert hvd.remove_process_set(hvd.global_process_set) is False
        with pytest.raises(ValueError, match="not registered"):
            hvd.allreduce(np.ones(1), process_set=ps)
    finally:
        hvd.shutdown()


# -- timeline -------------------------------------------------------------------------------------
def test_timeline_in_one_process(monkeypatch, tmp_path):
    import json

    hvd.shutdown()
    leave_launchers(monkeypatch)
    path = tmp_path / "sub" / "timeline.json"
    monkeypatch.setenv("HOROVOD_TIMELINE", str(path))
    hvd.init()
    try:
        hvd.allreduce(np.ones(4), name="w")
        hvd.allgather(np.ones(4), name="g")
    finally:
        hvd.shutdown()
    events = json.loads(path.read_text())
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"w", "g"} <= names
    kinds = {e.get("name") for e in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE", "NEGOTIATE_ALLGATHER",
            "ALLGATHER", "MPI_ALLGATHER"} <= kinds


# -- without MPI ----------------------------------------------------------------------------------
SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import hpc_horovod as hvd

    hvd.init()
    assert (hvd.size(), hvd.rank(), hvd.local_rank()) == (1, 0, 0)
    assert not hvd.mpi_enabled()
    assert hvd.allreduce(np.ones(3), op=hvd.Sum).tolist() == [1.0, 1.0, 1.0]
    assert hvd.allgather(np.ones((2, 2))).shape == (2, 2)
    assert hvd.broadcast_object({"k": 1}) == {"k": 1}
    hvd.barrier()
    hvd.shutdown()
    hvd.init()
    assert hvd.reducescatter(np.arange(4.0), op=hvd.Sum).tolist() == [0.0, 1.0, 2.0, 3.0]
    hvd.shutdown()
    assert hvd.mpi_built() is False  # mpi4py cannot be imported in this interpreter
    print("ATTEMPTS", sys.mpi4py_attempts)
""")

SITECUSTOMIZE = textwrap.dedent("""
    import sys

    sys.mpi4py_attempts = []


    class HideMpi4py:
        # Refuse mpi4py, and record who asked for it.
        def find_spec(self, name, path=None, target=None):
            if name == "mpi4py" or name.startswith("mpi4py."):
                sys.mpi4py_attempts.append(name)
                raise ImportError("mpi4py is hidden in this test")
            return None


    sys.meta_path.insert(0, HideMpi4py())
""")


def test_size_one_script_runs_without_mpi4py(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = clean_env({"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # only mpi_built() asked for mpi4py; init and the collectives never did
    assert "ATTEMPTS ['mpi4py']" in proc.stdout, proc.stdout + proc.stderr
    assert "mpi4py" not in proc.stderr


@pytest.mark.parametrize("launch", [
    # a plugin the MPI library does not speak: every task starts as an MPI singleton
    {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
     "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1",
     "SLURM_STEP_NODELIST": "node1", "SLURM_STEP_TASKS_PER_NODE": "2",
     "SLURM_MPI_TYPE": "pmi2"},
    {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"},
], ids=["srun-without-pmix", "explicit"])
def test_launcher_and_mpi_disagreeing_on_the_size_is_named(tmp_path, launch):
    code = "import hpc_horovod as hvd\nhvd.init()\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=clean_env({"PYTHONPATH": str(ROOT), **launch}), timeout=120,
                          cwd=tmp_path)
    assert proc.returncode != 0
    assert "MpiWiringError: MPI did not wire up the 2 tasks of this" in proc.stderr, proc.stderr
    assert "MPI sees a world of 1 process(es)" in proc.stderr
    assert "srun --mpi=pmix python" in proc.stderr


def test_srun_without_mpi_plugin_is_named_before_mpi_starts(tmp_path):
    """`srun --mpi=none`: no plugin variable at all; the error comes before MPI is loaded."""
    launch = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
              "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2",
              "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "node1",
              "SLURM_STEP_TASKS_PER_NODE": "2"}
    code = "import sys, hpc_horovod as hvd\ntry:\n    hvd.init()\nfinally:\n" \
           "    print('MPI loaded:', 'mpi4py.MPI' in sys.modules)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=clean_env({"PYTHONPATH": str(ROOT), **launch}), timeout=120,
                          cwd=tmp_path)
    assert proc.returncode != 0
    assert "MpiWiringError: MPI did not wire up the 2 tasks of this slurm launch: srun " \
           "started these 2 tasks without an MPI plugin" in proc.stderr, proc.stderr
    assert "srun --mpi=pmix" in proc.stderr
    assert "MPI loaded: False" in proc.stdout


def test_mpi_launch_without_mpi4py_names_the_install(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    script = tmp_path / "train.py"
    script.write_text("import hpc_horovod as hvd\nhvd.init()\n")
    env = clean_env({"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
                     "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert "TopologyError" in proc.stderr
    assert "rank 0 of 2 started by openmpi, but mpi4py is not installed" in proc.stderr
    assert "pip install hpc-horovod[mpi]" in proc.stderr



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
                handle = engine.submit(ops.allreduce_request(x, name=f"race.{t}.{i}", op=hvd.Sum))
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
    late = ops.allreduce_request(x, name="late", op=hvd.Sum)
    engine._push(late)
    assert late.done and isinstance(late.error, HorovodInternalError)
