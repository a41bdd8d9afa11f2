"""Every collective, every dtype, checked against numpy references computed from the whole job's
inputs: run by every rank of ``mpirun -np N python -m pytest`` (test_ops.py, N = 2, 3, 4)."""

from __future__ import annotations

import itertools
import time
import warnings
import zlib

import numpy as np
import pytest
from reference import (
    FLOATS,
    NUMERIC,
    adasum_reference,
    inputs,
    reduce_reference,
    reducescatter_rows,
    tolerance,
)

import hpc_horovod as hvd
from hpc_horovod.common.types import SUPPORTED_DTYPES

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
OPS = {"Average": hvd.Average, "Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product}
seeds = itertools.count(1)


@pytest.fixture(autouse=True)
def _job(request):
    """A running engine (a new one after a check that stopped it), and seeds of this check's
    own: the same on every rank whatever the checks before did."""
    global seeds
    hvd.init()
    seeds = itertools.count(zlib.crc32(request.node.name.encode()) % 10**6 * 1000)


def close(got, expected, dtype, what):
    assert got.dtype == np.dtype(dtype), f"{what}: dtype {got.dtype} != {dtype}"
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64),
                               err_msg=what, **tolerance(dtype))


@pytest.mark.parametrize("op_name", OPS)
@pytest.mark.parametrize("dtype", NUMERIC, ids=str)
def test_allreduce_every_dtype_and_op(dtype, op_name):
    op = OPS[op_name]
    for shape in [(), (5,), (3, 4)]:
        high = 2 if op == hvd.Product else 4
        low = -2 if op == hvd.Product else -4
        xs = inputs(SIZE, dtype, shape, next(seeds), low, high)
        got = hvd.allreduce(xs[RANK], op=op, name=f"ar.{dtype}.{op_name}.{len(shape)}")
        close(got, reduce_reference(xs, op), dtype, f"allreduce {dtype} {op_name} {shape}")


@pytest.mark.parametrize("op", [hvd.Min, hvd.Max], ids=["and", "or"])
def test_allreduce_bool(op):
    xs = inputs(SIZE, bool, (7,), next(seeds))
    got = hvd.allreduce(xs[RANK], op=op)
    assert got.dtype == np.bool_
    assert got.tolist() == reduce_reference(xs, op).tolist(), (op, got)


def test_scaling_and_average():
    for dtype in NUMERIC:
        xs = inputs(SIZE, dtype, (6,), next(seeds))
        for op, pre, post in [(hvd.Sum, 2.0, 3.0), (hvd.Average, 0.5, 4.0), (hvd.Max, 3.0, 1.0),
                              (hvd.Sum, 1.0, 0.5)]:
            got = hvd.allreduce(xs[RANK], op=op, prescale_factor=pre, postscale_factor=post)
            close(got, reduce_reference(xs, op, pre, post), dtype,
                  f"scaled allreduce {dtype} op={op} pre={pre} post={post}")
    xs = inputs(SIZE, np.float32, (4,), next(seeds))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summed = hvd.allreduce(xs[RANK], average=False)
        averaged = hvd.allreduce(xs[RANK], average=True)
    assert all(issubclass(w.category, DeprecationWarning) for w in caught) and len(caught) == 2
    close(summed, reduce_reference(xs, hvd.Sum), np.float32, "average=False")
    close(averaged, reduce_reference(xs, hvd.Average), np.float32, "average=True")
    close(hvd.allreduce(xs[RANK]), reduce_reference(xs, hvd.Average), np.float32, "default op")


def test_in_place():
    for dtype in (np.float32, np.float16, np.int64):
        xs = inputs(SIZE, dtype, (3, 3), next(seeds))
        buf = xs[RANK].copy()
        out = hvd.allreduce_(buf, op=hvd.Sum, prescale_factor=2.0)
        assert out is buf
        close(buf, reduce_reference(xs, hvd.Sum, 2.0), dtype, f"in-place {dtype}")
    xs = inputs(SIZE, np.float64, (5,), next(seeds))
    buf = xs[RANK].copy()
    assert hvd.synchronize(hvd.allreduce_async_(buf, op=hvd.Adasum)) is buf
    np.testing.assert_allclose(buf, adasum_reference(xs), rtol=1e-12)


def test_adasum():
    for dtype in FLOATS:
        xs = [x.astype(np.float64) for x in inputs(SIZE, np.float64, (4, 8), next(seeds))]
        xs = [(x + 0.25 * (r + 1)).astype(dtype) for r, x in enumerate(xs)]
        got = hvd.allreduce(xs[RANK], op=hvd.Adasum, name=f"adasum.{dtype}")
        expected = adasum_reference(xs)
        assert got.dtype == dtype and got.shape == (4, 8)
        tol = {"rtol": 1e-12} if dtype == np.float64 else tolerance(dtype)
        np.testing.assert_allclose(got.astype(np.float64), expected, **tol)
    if SIZE == 2:  # the pairwise formula written out
        a = np.array([1.0, 2.0, 0.0]) if RANK == 0 else np.array([0.0, 2.0, 2.0])
        b = np.array([0.0, 2.0, 2.0])
        a0 = np.array([1.0, 2.0, 0.0])
        dot = a0 @ b
        expected = (1 - dot / (2 * (a0 @ a0))) * a0 + (1 - dot / (2 * (b @ b))) * b
        np.testing.assert_allclose(hvd.allreduce(a, op=hvd.Adasum), expected, rtol=1e-14)
        # orthogonal gradients add up, identical ones do not double
        e = np.eye(2)[RANK]
        np.testing.assert_allclose(hvd.allreduce(e, op=hvd.Adasum), [1.0, 1.0])
        same = np.array([3.0, -1.0])
        np.testing.assert_allclose(hvd.allreduce(same, op=hvd.Adasum), same)
    xs = inputs(SIZE, np.float32, (6,), next(seeds))
    got = hvd.allreduce(xs[RANK], op=hvd.Adasum, prescale_factor=0.5, postscale_factor=2.0)
    np.testing.assert_allclose(got, adasum_reference(xs, 0.5, 2.0), rtol=1e-5, atol=1e-6)


def test_grouped():
    dtypes = [np.float32, np.float64, np.int32, np.float16]
    xs = [inputs(SIZE, d, (r + 2, 3), next(seeds)) for r, d in enumerate(dtypes)]
    outs = hvd.grouped_allreduce([x[RANK] for x in xs], op=hvd.Sum, name="grouped")
    for d, x, out in zip(dtypes, xs, outs):
        close(out, reduce_reference(x, hvd.Sum), d, f"grouped {d}")
    gathered = hvd.grouped_allgather([x[RANK] for x in xs])
    for x, out in zip(xs, gathered):
        np.testing.assert_array_equal(out, np.concatenate(x))
    rows = 2 * SIZE + 1
    ys = [inputs(SIZE, d, (rows, 2), next(seeds)) for d in (np.float32, np.int64)]
    scattered = hvd.grouped_reducescatter([y[RANK] for y in ys], op=hvd.Sum)
    counts = reducescatter_rows(rows, SIZE)
    start = sum(counts[:RANK])
    for y, out in zip(ys, scattered):
        full = reduce_reference(y, hvd.Sum)
        np.testing.assert_array_equal(out, full[start:start + counts[RANK]])


def test_allgather():
    for dtype in SUPPORTED_DTYPES:
        for rest in [(), (3,), (2, 2)]:
            # a different number of rows per rank, one rank with none at all
            rows = [0 if r == 1 else 2 * r + 1 for r in range(SIZE)]
            seed = next(seeds)
            xs = [inputs(SIZE, dtype, (rows[r],) + rest, seed)[r] for r in range(SIZE)]
            got = hvd.allgather(xs[RANK], name=f"ag.{dtype}.{len(rest)}")
            assert got.dtype == np.dtype(dtype) and got.shape == (sum(rows),) + rest
            np.testing.assert_array_equal(got, np.concatenate(xs))
    scalar = hvd.allgather(np.int32(RANK))
    assert scalar.tolist() == list(range(SIZE))


def test_broadcast():
    for dtype, root in itertools.product(SUPPORTED_DTYPES, range(SIZE)):
        xs = inputs(SIZE, dtype, (4, 3), next(seeds))
        original = xs[RANK].copy()
        got = hvd.broadcast(xs[RANK], root_rank=root, name=f"bc.{dtype}.{root}")
        np.testing.assert_array_equal(got, xs[root])
        np.testing.assert_array_equal(xs[RANK], original)  # the input is left alone
        assert got.dtype == np.dtype(dtype)
    for root in range(SIZE):
        buf = np.full(5, RANK, np.int16)
        assert hvd.broadcast_(buf, root) is buf
        assert buf.tolist() == [root] * 5
    scalar = hvd.broadcast(np.float64(RANK + 0.5), root_rank=SIZE - 1)
    assert scalar.shape == () and float(scalar) == SIZE - 0.5


def test_alltoall():
    for dtype in SUPPORTED_DTYPES:
        xs = inputs(SIZE, dtype, (2 * SIZE, 3), next(seeds))
        got, splits = hvd.alltoall(xs[RANK], name=f"a2a.{dtype}")
        expected = np.concatenate([x[2 * RANK:2 * RANK + 2] for x in xs])
        np.testing.assert_array_equal(got, expected)
        assert got.dtype == np.dtype(dtype) and splits.tolist() == [2] * SIZE
    # with splits, zero splits included: rank r sends j rows to rank j, none to itself
    table = [[0 if i == j else (i + j) % 3 + 1 for j in range(SIZE)] for i in range(SIZE)]
    table[0][SIZE - 1] = 0
    xs = [np.arange(sum(table[i]) * 2, dtype=np.float32).reshape(-1, 2) + 100 * i
          for i in range(SIZE)]
    got, splits = hvd.alltoall(xs[RANK], splits=table[RANK])
    assert splits.tolist() == [table[i][RANK] for i in range(SIZE)]
    parts = []
    for i in range(SIZE):
        start = sum(table[i][:RANK])
        parts.append(xs[i][start:start + table[i][RANK]])
    np.testing.assert_array_equal(got, np.concatenate(parts))
    # a rank with nothing at all to send
    send = np.zeros((0, 4), np.int8) if RANK == 0 else np.ones((SIZE, 4), np.int8) * RANK
    splits_out = [0] * SIZE if RANK == 0 else [1] * SIZE
    got, splits = hvd.alltoall(send, splits=splits_out)
    assert splits.tolist() == [0] + [1] * (SIZE - 1)
    assert got.shape == (SIZE - 1, 4) and got[:, 0].tolist() == list(range(1, SIZE))
    # splits must match the process set
    try:
        hvd.alltoall(np.ones(3), splits=[3])
    except ValueError as exc:
        assert f"the process set has {SIZE} ranks" in str(exc)
    else:
        raise AssertionError("alltoall accepted a wrong number of splits")


def test_reducescatter():
    for dtype, rows in itertools.product([np.float16, np.float32, np.int32, np.float64],
                                         [2 * SIZE, 2 * SIZE + 1, SIZE - 1]):
        for op in (hvd.Sum, hvd.Average, hvd.Max):
            xs = inputs(SIZE, dtype, (rows, 3), next(seeds))
            got = hvd.reducescatter(xs[RANK], op=op)
            counts = reducescatter_rows(rows, SIZE)
            start = sum(counts[:RANK])
            expected = reduce_reference(xs, op)[start:start + counts[RANK]]
            close(got, expected, dtype, f"reducescatter {dtype} rows={rows} op={op}")
    xs = inputs(SIZE, np.float32, (SIZE,), next(seeds))
    got = hvd.reducescatter(xs[RANK], op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    close(got, reduce_reference(xs, hvd.Sum)[RANK:RANK + 1], np.float32, "scaled reducescatter")


def test_out_of_order_submission():
    names = ["a", "b", "c", "d"]
    order = names if RANK % 2 == 0 else names[::-1]
    xs = {n: inputs(SIZE, np.float32, (8,), 1000 + i) for i, n in enumerate(names)}
    handles = {n: hvd.allreduce_async(xs[n][RANK], name=f"ooo.{n}", op=hvd.Sum) for n in order}
    if RANK == SIZE - 1:
        time.sleep(0.2)  # the others' submissions wait for this rank's
    for n in names:
        close(hvd.synchronize(handles[n]), reduce_reference(xs[n], hvd.Sum), np.float32,
              f"out of order {n}")
    # mixed kinds, submitted in different orders, all asynchronous
    h_gather = hvd.allgather_async(np.full(2, RANK), name="mixed.gather")
    h_bcast = hvd.broadcast_async(np.full(2, RANK), root_rank=0, name="mixed.bcast")
    if RANK % 2:
        h_a2a = hvd.alltoall_async(np.arange(SIZE), name="mixed.a2a")
        h_red = hvd.allreduce_async(np.ones(2), name="mixed.red", op=hvd.Sum)
    else:
        h_red = hvd.allreduce_async(np.ones(2), name="mixed.red", op=hvd.Sum)
        h_a2a = hvd.alltoall_async(np.arange(SIZE), name="mixed.a2a")
    assert hvd.synchronize(h_red).tolist() == [SIZE, SIZE]
    assert hvd.synchronize(h_a2a)[0].tolist() == [RANK] * SIZE
    assert hvd.synchronize(h_bcast).tolist() == [0, 0]
    assert hvd.synchronize(h_gather).tolist() == sum([[r, r] for r in range(SIZE)], [])


def test_duplicate_name_in_flight():
    if RANK == 0:
        first = hvd.allreduce_async(np.ones(2), name="dup", op=hvd.Sum)
        try:
            hvd.allreduce_async(np.ones(2), name="dup", op=hvd.Sum)
        except ValueError as exc:
            assert "same name as another tensor that is currently being processed" in str(exc)
        else:
            raise AssertionError("a second 'dup' in flight was accepted")
        hvd.barrier()  # only now may the others submit theirs
    else:
        hvd.barrier()
        first = hvd.allreduce_async(np.ones(2), name="dup", op=hvd.Sum)
    assert hvd.synchronize(first).tolist() == [SIZE, SIZE]


def test_barrier_and_objects():
    for _ in range(3):
        hvd.barrier()
    obj = {"rank": RANK, "payload": list(range(RANK * 100)), "fn": lambda v: v * 2}
    for root in range(SIZE):
        got = hvd.broadcast_object(obj, root_rank=root)
        assert got["rank"] == root and len(got["payload"]) == root * 100
        assert got["fn"](21) == 42
    gathered = hvd.allgather_object({"rank": RANK, "text": "x" * (RANK * 1000 + 1)})
    assert [g["rank"] for g in gathered] == list(range(SIZE))
    assert [len(g["text"]) for g in gathered] == [r * 1000 + 1 for r in range(SIZE)]
    assert hvd.broadcast_object(None if RANK else [1, 2], root_rank=0) == [1, 2]


def test_poll_and_many_in_flight():
    handles = [hvd.allreduce_async(np.full(3, RANK + i, np.int64), op=hvd.Sum)
               for i in range(64)]
    deadline = time.monotonic() + 60
    while not all(hvd.poll(h) for h in handles):
        assert time.monotonic() < deadline, "64 allreduces did not complete"
        time.sleep(0.001)
    for i, h in enumerate(handles):
        assert hvd.synchronize(h).tolist() == [sum(r + i for r in range(SIZE))] * 3


def test_queries():
    assert hvd.local_size() == SIZE and hvd.local_rank() == RANK  # one machine
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0
    assert hvd.is_homogeneous() and hvd.mpi_enabled() and hvd.mpi_built()
    assert isinstance(hvd.mpi_threads_supported(), bool)
    assert hvd.global_process_set.size() == SIZE and hvd.global_process_set.rank() == RANK


def test_reinit():
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init()
    assert (hvd.rank(), hvd.size()) == (RANK, SIZE)
    assert hvd.allreduce(np.array([1.0]), op=hvd.Sum, name="ar.f32.Sum.0").tolist() == [SIZE]
    hvd.shutdown()
    hvd.init()
    assert hvd.allgather(np.array([RANK])).tolist() == list(range(SIZE))


