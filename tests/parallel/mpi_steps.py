"""Run by every rank of ``mpirun -np N python -m pytest`` (test_ops.py): training-like steps that
resubmit the same names, so the engine's cached execution plans are reused, and must be dropped
when the tensors change; each also with a response cache of 16 names (30 to 40 names a step:
names are evicted and cached again).

Every step's inputs depend on the step, so a stale plan, a stale result view or a result written
into the wrong tensor fails the numpy comparison. Also submits from several threads at once
(the lock-free submission path) and checks every result.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from reference import inputs, reduce_reference, tolerance

import hpc_horovod as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()

DTYPES = [np.float32, np.float64, np.int32, np.float16]


@pytest.fixture(autouse=True, params=["cache-default", "cache-16"])
def _job(request, monkeypatch):
    """The engine, with the default response cache or one of 16 names (started again)."""
    hvd.init()  # a new engine after a check that stopped it
    if request.param == "cache-16":
        monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "16")
        hvd.shutdown()
        hvd.init()
    yield
    if request.param == "cache-16":
        hvd.shutdown()
        monkeypatch.undo()
        hvd.init()


def spec(i: int, step: int):
    dtype = DTYPES[i % len(DTYPES)]
    shape = (i % 7 + 1,) if i % 3 else (i % 4 + 1, 2)
    if step >= 5 and i == 3:  # a name whose shape changes: its cache bit is reassigned
        shape = (9, 3)
    return dtype, shape, [hvd.Sum, hvd.Average, hvd.Max][i % 3]


def check(out, expected, dtype, what):
    np.testing.assert_allclose(np.asarray(out, np.float64), expected.astype(np.float64),
                               err_msg=what, **tolerance(dtype))


def test_grouped_steps():
    """One grouped submission per step: every rank enqueues the group at once, so every step's
    ready set is the same and its plan is reused, until a shape changes (step 5) or the group
    does (7)."""
    for step in range(10):
        count = 20 if step >= 7 else 30
        specs = [spec(i, step) for i in range(count)]
        data = [inputs(SIZE, dtype, shape, 500 * step + i) for i, (dtype, shape, _) in
                enumerate(specs)]
        outs = hvd.grouped_allreduce([d[RANK] for d in data], name="grouped", op=hvd.Sum)
        for i, (out, d, (dtype, shape, _)) in enumerate(zip(outs, data, specs)):
            assert out.shape == shape and out.dtype == np.dtype(dtype), (step, i, out.shape)
            check(out, reduce_reference(d, hvd.Sum), dtype, f"grouped step {step} tensor {i}")


def test_steps_one_by_one():
    """Tensors submitted one by one, in place and not, with an allgather and a broadcast in the
    same steps: ready sets vary with timing, plans come and go."""
    for step in range(10):
        # From step 7 on only every other tensor: a different ready set, hence another plan.
        members = range(0, 40, 2) if step >= 7 else range(40)
        pending = {}
        for i in members:
            dtype, shape, op = spec(i, step)
            data = inputs(SIZE, dtype, shape, 1000 * step + i)
            if i % 2:  # in place
                mine = data[RANK].copy()
                handle = hvd.allreduce_async_(mine, name=f"grad.{i}", op=op)
            else:
                mine = data[RANK]
                handle = hvd.allreduce_async(mine, name=f"grad.{i}", op=op)
            pending[i] = (handle, data, op, dtype, mine)
        rows = inputs(SIZE, np.float32, (RANK + 1, 3), 77 + step)
        gather = hvd.allgather_async(rows[RANK], name="rows")
        root = step % SIZE
        bcast = hvd.broadcast_async(np.full(4, float(RANK + step), np.float32), root, name="bcast")
        for i, (handle, data, op, dtype, mine) in pending.items():
            out = hvd.synchronize(handle)
            check(out, reduce_reference(data, op), dtype, f"step {step} tensor {i}")
            if i % 2:
                assert out is mine, f"step {step} tensor {i}: the in-place result is another array"
        gathered = hvd.synchronize(gather)
        expected = np.concatenate([inputs(SIZE, np.float32, (r + 1, 3), 77 + step)[r]
                                   for r in range(SIZE)])
        check(gathered, expected, np.float32, f"step {step} allgather")
        check(hvd.synchronize(bcast), np.full(4, float(root + step)), np.float32,
              f"step {step} broadcast")



def submit_from_thread(t: int, results: dict) -> None:
    handles = {}
    for i in range(25):
        x = np.full(5 + i, float(RANK + t + i), np.float32)
        handles[i] = hvd.allreduce_async(x, name=f"thread{t}.{i}", op=hvd.Sum)
    results[t] = {i: hvd.synchronize(h) for i, h in handles.items()}


def test_submissions_from_threads():
    for round_ in range(3):
        results: dict = {}
        threads = [threading.Thread(target=submit_from_thread, args=(t, results)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for t in range(4):
            for i in range(25):
                want = sum(float(r + t + i) for r in range(SIZE))
                assert results[t][i].tolist() == [want] * (5 + i), (round_, t, i)
