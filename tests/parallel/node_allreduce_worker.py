"""Run on every rank by test_node_allreduce.py: the shared-memory allreduce
(``backends/shm.py``), both ways (numpy on staged buffers, and the native sums of the ranks' own
tensors), against MPI's allreduce of the same inputs, then its life inside hpc_horovod (created
on first use, released when the ranks agree to stop, created again by the next ``init``).

With 2 ranks every operation gives MPI's bits exactly (one reduction step, and ``a op b`` is
commutative). With more ranks floating-point sums may round differently from MPI's order, so
they are compared within rounding, and every rank must hold the same bits.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import ml_dtypes
import numpy as np
from mpi4py import MPI

import hpc_horovod as hvd
from hpc_horovod.backends.mpi import MpiBackend
from hpc_horovod.backends.shm import NodeAllreduce
from hpc_horovod.common import basics
from hpc_horovod.common.types import Max, Min, Product, Sum

try:
    from hpc_horovod import _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
CAPACITY = 1 << 16  # small, so that a few hundred KiB already go through several chunks
COUNTS = [0, 1, 3, 17, 1000, CAPACITY // 4 + 5, 3 * CAPACITY + 1]


def inputs(dtype: np.dtype, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, RANK])
    if dtype == np.bool_:
        return rng.random(n) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), n, dtype=dtype)
    return (rng.standard_normal(n) * 4).astype(dtype)


def check_absent_peer_is_reported() -> None:
    """Rank 0 waits in the window's barrier for peers that come 1 s late: with a 0.3 s
    timeout it gets an error naming the reduction instead of a hang. Its pending barrier
    then completes with the latecomers', and one more barrier lets them through the second."""
    comm = COMM.Dup()
    node = NodeAllreduce(comm, CAPACITY)
    staged = node.stage(4, np.dtype(np.float32))
    staged[...] = 1.0
    if RANK == 0:
        try:
            node.reduce(staged, Sum, timeout_s=0.3)
        except hvd.HorovodInternalError as exc:
            assert "no answer from some of the" in str(exc), exc
            assert "shared-memory allreduce of 4 x float32" in str(exc), exc
        else:
            raise AssertionError("no error although the peers never came")
        comm.Ibarrier().Wait()
    else:
        time.sleep(1.0)
        node.reduce(staged, Sum, timeout_s=30)
    node.free()
    comm.Free()


def node_allreduce(node: NodeAllreduce, x: np.ndarray, op: int) -> None:
    """In place, through the window one segment at a time."""
    step = CAPACITY // x.dtype.itemsize
    for start in range(0, x.size, step):
        part = x[start:start + step]
        staged = node.stage(part.size, part.dtype)
        staged[...] = part
        part[...] = node.reduce(staged, op)


def same_on_every_rank(a: np.ndarray, what: str) -> None:
    digest = hashlib.sha256(np.ascontiguousarray(a).view(np.uint8)).hexdigest()
    assert len(set(COMM.allgather(digest))) == 1, f"{what}: ranks hold different results"


def check_against_mpi(node: NodeAllreduce) -> None:
    mpi = MpiBackend(COMM.Dup(), shared_memory=False)
    seed = 0
    for dtype in map(np.dtype, [np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_]):
        ops = [Min, Max] if dtype == np.bool_ else [Sum, Min, Max, Product]
        for op in ops:
            for n in COUNTS:
                seed += 1
                x = inputs(dtype, n, seed)
                want = x.copy()
                mpi.allreduce(want, op)
                got = x.copy()
                with np.errstate(over="ignore", invalid="ignore"):
                    node_allreduce(node, got, op)
                what = f"{dtype} op {op}, {n} elements"
                if dtype.kind == "f" and SIZE > 2 and op in (Sum, Product):
                    # two orders of SIZE - 1 roundings each, of values at most sum(|x|)
                    # (for a product: relative to the result)
                    xs = np.abs(np.array(COMM.allgather(x), dtype=np.float64))
                    scale = xs.sum(axis=0) if op == Sum else np.abs(want.astype(np.float64))
                    bound = 2 * (SIZE - 1) * np.finfo(dtype).eps * scale
                    error = np.abs(got.astype(np.float64) - want)
                    assert np.all(error <= bound), f"{what}: off by {np.max(error - bound)}"
                else:
                    assert np.array_equal(got, want), what
                same_on_every_rank(got, what)
    # Open MPI 4.1's AVX sums saturate 8- and 16-bit integers; both paths must wrap, as numpy
    for dtype in map(np.dtype, [np.uint8, np.int8, np.int16, np.uint16]):
        big = np.iinfo(dtype).max - 5
        for n in (3, 100):
            for reduce in (lambda a: mpi.allreduce(a, Sum), lambda a: node_allreduce(node, a, Sum)):
                got = np.full(n, big, dtype)
                reduce(got)
                want = (np.full(n, big, np.int64) * SIZE).astype(dtype)
                assert np.array_equal(got, want), f"{dtype} sum of {n} did not wrap: {got[:3]}"
    mpi.free()


def check_half_sums(node: NodeAllreduce) -> None:
    if _native is None:
        return
    for dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        for n in COUNTS:
            x = inputs(np.dtype(np.float32), n, 7 + n).astype(dtype)
            xs = COMM.allgather(x)
            got = x.copy()
            node_allreduce(node, got, Sum)
            exact = sum(v.astype(np.float64) for v in xs)
            if SIZE == 2:
                want = (xs[0].astype(np.float32) + xs[1].astype(np.float32)).astype(dtype)
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (dtype, n)
            else:
                bound = float(ml_dtypes.finfo(dtype).eps) * (SIZE - 1) * (
                    sum(np.abs(v.astype(np.float64)) for v in xs))
                assert np.all(np.abs(got.astype(np.float64) - exact) <= bound + 1e-7), (dtype, n)
            same_on_every_rank(got, f"{dtype} sum, {n} elements")


def check_staging_under_skew(node: NodeAllreduce) -> None:
    """Fill, reduce and read 200 buffers in a row with ranks arriving at random moments: a rank
    that runs ahead fills the other slot while a slow one still reads the previous result."""
    rng = np.random.default_rng(RANK)
    for step in range(200):
        n = int(rng.integers(1, CAPACITY // 4)) if step % 7 else CAPACITY // 4
        n = COMM.bcast(n)
        staged = node.stage(n, np.dtype(np.float32))
        staged[...] = np.arange(n, dtype=np.float32) + step * (RANK + 1)
        if rng.random() < 0.3:
            time.sleep(float(rng.uniform(0, 2e-3)))
        result = node.reduce(staged, Sum)
        assert not result.flags.writeable, "the shared result must be read-only"
        if rng.random() < 0.3:
            time.sleep(float(rng.uniform(0, 2e-3)))
        want = SIZE * np.arange(n, dtype=np.float32) + step * SIZE * (SIZE + 1) / 2
        assert np.array_equal(result, want), f"step {step}: wrong result"
    try:
        node.stage(CAPACITY // 4 + 1, np.dtype(np.float32))
    except ValueError as exc:
        assert "more than the" in str(exc)
    else:
        raise AssertionError("stage accepted more than a segment")
    staged = node.stage(4, np.dtype(np.float32))
    try:
        node.reduce(np.zeros(4, np.float32), Sum)
    except RuntimeError as exc:
        assert "not the last one staged" in str(exc)
    else:
        raise AssertionError("reduce accepted a buffer that was not staged")
    node.reduce(staged, Sum)  # keep the ranks in step


#: tensor sizes of native groups: empty ones, ones across the 64-byte slice bounds and the
#: 64 KiB blocks, one that fills the segment
GROUPS = [[4096] * 3, [7, 0, 5000, 1, 0], [1], [0, 0], [CAPACITY // 8], [3] * 300]


def native_groups(dtype: np.dtype, seed: int):
    rng = np.random.default_rng([seed, RANK])
    for sizes in GROUPS:
        if sum(sizes) * dtype.itemsize > CAPACITY:
            sizes = [n // 2 for n in sizes]
        yield sizes, [(rng.standard_normal(n) * 4).astype(dtype) for n in sizes]


def check_native_sums_against_mpi(node: NodeAllreduce) -> None:
    """reduce_arrays, in place and out of place, unscaled and scaled: with 2 ranks MPI's bits
    (float16/bfloat16: the float32 sum rounded once, as the native MPI operation does), with
    more within rounding of a float64 sum, and the same bits on every rank."""
    if _native is None:
        return
    dtypes = map(np.dtype, [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
    for seed, dtype in enumerate(dtypes):
        for sizes, xs in native_groups(dtype, seed):
            for in_place, factor in ((True, 1.0), (False, 1.0), (True, 0.5)):
                tensors = [x.copy() for x in xs]
                outputs = tensors if in_place else [np.full_like(x, np.nan) for x in xs]
                node.reduce_arrays(tensors, outputs, dtype, factor, timeout_s=30.0)
                what = f"{dtype} x {sizes[:4]}, in place {in_place}, factor {factor}"
                for x, got in zip(xs, outputs):
                    everyone = COMM.allgather(x)
                    if SIZE == 2 and factor == 1.0:
                        want = (everyone[0].astype(np.float32) + everyone[1].astype(np.float32)
                                if dtype.itemsize == 2 else everyone[0] + everyone[1])
                        assert np.array_equal(got.view(np.uint8),
                                              want.astype(dtype).view(np.uint8)), what
                    else:
                        exact = factor * sum(e.astype(np.float64) for e in everyone)
                        scale = factor * sum(np.abs(e.astype(np.float64)) for e in everyone)
                        eps = float(ml_dtypes.finfo(dtype).eps)
                        bound = 2 * SIZE * eps * scale + 1e-30
                        error = np.abs(got.astype(np.float64) - exact)
                        assert np.all(error <= bound), f"{what}: off by {np.max(error - bound)}"
                    same_on_every_rank(got, what)
                if not in_place:
                    assert all(np.array_equal(t, x) for t, x in zip(tensors, xs)), what
    try:
        big = [np.zeros(CAPACITY // 8, np.float32), np.zeros(CAPACITY // 8 + 1, np.float32)]
        node.reduce_arrays(big, big, np.dtype(np.float32), 1.0)
    except ValueError as exc:  # before anything is copied or waited for
        assert "is more than the 65536 bytes of a segment" in str(exc), exc
    else:
        raise AssertionError("reduce_arrays took a group larger than a segment")


def check_both_ways_under_skew(node: NodeAllreduce) -> None:
    """Native sums and staged reductions alternating, 300 in a row, with ranks arriving at
    random moments: a rank that runs ahead copies into the other slot, or starts the next
    reduction, while a slow one still copies results out of the previous one."""
    if _native is None:
        return
    rng = np.random.default_rng(RANK + 100)
    f32 = np.dtype(np.float32)
    for step in range(300):
        n = COMM.bcast(int(rng.integers(1, CAPACITY // 16)))
        if rng.random() < 0.3:
            time.sleep(float(rng.uniform(0, 1e-3)))
        if step % 3 == 2:
            staged = node.stage(n, f32)
            staged[...] = np.arange(n, dtype=np.float32) + step * (RANK + 1)
            got = node.reduce(staged, Sum).copy()
        else:
            parts = [np.arange(n, dtype=np.float32) + step * (RANK + 1)]
            parts.append(np.full(3, RANK, np.float32))
            node.reduce_arrays(parts, parts, f32, 1.0, timeout_s=30.0)
            assert np.all(parts[1] == SIZE * (SIZE - 1) / 2), f"step {step}: second tensor"
            got = parts[0]
        want = SIZE * np.arange(n, dtype=np.float32) + step * SIZE * (SIZE + 1) / 2
        assert np.array_equal(got, want), f"step {step}: wrong result"


def check_native_sums_in_rounds() -> None:
    """Groups of several rounds (src_native/window.c: of 1 MiB up to 8 MiB, ordinary stores; of
    256 KiB above, streaming stores), tensors of every size cut across round and slice bounds,
    slices with fewer rounds than others or none, and ranks arriving at random moments: the
    bits every rank gets are MPI's (2 ranks) or within rounding of a float64 sum, the same on
    every rank."""
    if _native is None:
        return
    comm = COMM.Dup()
    capacity = 12 << 20
    node = NodeAllreduce(comm, capacity)
    rng = np.random.default_rng(7)  # the same sizes on every rank
    f32 = np.dtype(np.float32)
    cached, streamed = (1 << 20) // 4, (256 << 10) // 4  # floats per round
    largest, cached_largest = capacity // 4, (8 << 20) // 4
    totals = [1, 16, cached * SIZE - 1, 2 * cached * SIZE + 16, cached_largest,
              cached_largest + 1, cached_largest + 2 * streamed * SIZE + 16, largest]
    randoms = [int(t) for t in rng.integers(1, largest, 12)]
    for step, total in enumerate(totals + randoms):
        cuts = np.sort(rng.integers(0, total, int(rng.integers(0, 40))))
        sizes = np.diff(np.concatenate([[0], cuts, [total]])).tolist()  # empty ones included
        mine = np.random.default_rng([step, RANK])
        xs = [(mine.standard_normal(n) * 4).astype(np.float32) for n in sizes]
        in_place = step % 2 == 0
        outputs = [x.copy() for x in xs] if in_place else [np.empty_like(x) for x in xs]
        if mine.random() < 0.3:
            time.sleep(float(mine.uniform(0, 2e-3)))
        node.reduce_arrays(outputs if in_place else xs, outputs, f32, 1.0, timeout_s=30.0)
        got = np.concatenate(outputs)
        everyone = comm.allgather(np.concatenate(xs))
        what = f"{total} floats in {len(sizes)} tensors"
        if SIZE == 2:
            assert np.array_equal(got, everyone[0] + everyone[1]), what
        else:
            exact = sum(e.astype(np.float64) for e in everyone)
            bound = 2 * SIZE * np.finfo(np.float32).eps * sum(np.abs(e) for e in everyone)
            assert np.all(np.abs(got - exact) <= bound + 1e-30), what
        same_on_every_rank(got, what)
    comm.Barrier()
    node.free()
    comm.Free()


def check_absent_peer_in_native_sum() -> None:
    """Rank 0 waits for peers that come 1 s late: with a 0.3 s timeout it gets an error naming
    the ranks that did not come instead of a hang. The latecomers then wait for rank 0, which
    has gone, and their error names it. A signal's exception ends a wait without a limit."""
    if _native is None:
        return
    comm = COMM.Dup()
    node = NodeAllreduce(comm, CAPACITY)
    tensors = [np.ones(1000, np.float32), np.ones(10, np.float32)]
    f32 = np.dtype(np.float32)
    if RANK == 0:
        started = time.monotonic()
        try:
            node.reduce_arrays(tensors, tensors, f32, 1.0, timeout_s=0.3)
        except hvd.HorovodInternalError as exc:
            late = " ".join(str(q) for q in range(1, SIZE))
            assert f"rank(s) {late} did not write their part of the group within" in str(exc)
            assert "shared-memory allreduce of 2 tensors of float32" in str(exc), exc
        else:
            raise AssertionError("no error although the peers never came")
        assert time.monotonic() - started < 5.0
    else:
        time.sleep(1.0)
        try:
            node.reduce_arrays(tensors, tensors, f32, 1.0, timeout_s=0.3)
        except hvd.HorovodInternalError as exc:
            assert "rank(s) 0 did not sum their slice of the group within" in str(exc), exc
        else:
            raise AssertionError("no error although rank 0 had gone")
    comm.Barrier()
    node.free()

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted

    node = NodeAllreduce(comm, CAPACITY)
    if RANK == 0:
        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        started = time.monotonic()
        try:
            node.reduce_arrays(tensors, tensors, f32, 1.0, timeout_s=0.0)
        except Interrupted:
            assert time.monotonic() - started < 5.0
        else:
            raise AssertionError("the signal did not end the wait")
        finally:
            signal.signal(signal.SIGALRM, previous)
    else:
        time.sleep(1.0)
        try:
            node.reduce_arrays(tensors, tensors, f32, 1.0, timeout_s=0.3)
        except hvd.HorovodInternalError:
            pass
    comm.Barrier()
    node.free()
    comm.Free()


def hvd_backend():
    return basics._require().engine.backend


def check_inside_hpc_horovod() -> None:
    for _ in range(2):  # the window is released at shutdown and created again
        hvd.init()
        backend = hvd_backend()
        if os.environ.get("HOROVOD_SHM_DISABLE") == "1":
            assert backend.fusion_capacity is None, "HOROVOD_SHM_DISABLE=1 kept the window"
        else:
            assert backend.fusion_capacity, "all ranks share this node but there is no window"
        grads = [np.full(1000 + i, RANK + i, np.float32) for i in range(50)]
        handles = [hvd.allreduce_async(g, name=f"g{i}", op=hvd.Sum) for i, g in enumerate(grads)]
        for i, h in enumerate(handles):
            got = hvd.synchronize(h)
            assert np.all(got == SIZE * i + SIZE * (SIZE - 1) / 2), f"fused tensor {i}"
        handles = [hvd.allreduce_async_(g, name=f"g{i}") for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)
        for i, g in enumerate(grads):
            assert np.allclose(g, i + (SIZE - 1) / 2), f"in-place average {i}"
        # fused float sums go through the window, natively
        assert (backend._node is not None) == bool(backend.fusion_capacity), "window unused"
        assert backend._peer is None, "fused sums do not need the peers' memory"
        counts = [np.full(1000 + i, RANK + i, np.int32) for i in range(50)]
        handles = [hvd.allreduce_async_(c, name=f"c{i}", op=hvd.Sum) for i, c in enumerate(counts)]
        for h in handles:
            hvd.synchronize(h)
        for i, c in enumerate(counts):
            assert np.all(c == SIZE * i + SIZE * (SIZE - 1) // 2), f"in-place int sum {i}"
        big = np.full(3 << 20, RANK + 1.0)  # alone, in place: through the peers' memory
        hvd.allreduce_(big, op=hvd.Sum)
        assert np.all(big == SIZE * (SIZE + 1) / 2)
        assert (backend._peer is not None) == bool(backend.fusion_capacity), "peers unused"
        COMM.Barrier()  # no rank stops (which releases every rank's window) before all looked
        hvd.shutdown()
        assert hvd_or_none() is None


def check_ranks_that_differ_locally() -> None:
    """In place on some ranks, out of place on others, joined on others: every rank must take
    the same path through the window (a rank reducing through MPI while its peers wait in the
    window's barriers would hang)."""
    hvd.init()
    for step in range(3):
        grads = [np.full(300 + i, RANK + 1.0, np.float32) for i in range(6)]
        in_place = (RANK + step) % 2 == 0
        submit = hvd.allreduce_async_ if in_place else hvd.allreduce_async
        handles = [submit(g, name=f"mixed{i}", op=hvd.Sum) for i, g in enumerate(grads)]
        for h in handles:
            got = hvd.synchronize(h)
            assert np.all(got == SIZE * (SIZE + 1) / 2), f"step {step}: mixed paths"
    if RANK == SIZE - 1:  # the last rank joins at once and contributes zeros
        hvd.join()
    else:
        for shapes in ([(5,), (7, 3), (11,)], [(100,)]):  # a fused group, a single tensor
            tensors = [np.full(shape, 2.0, np.float32) for shape in shapes]
            handles = [hvd.allreduce_async_(t, name=f"joined{len(shapes)}.{i}", op=hvd.Sum)
                       for i, t in enumerate(tensors)]
            for t, h in zip(tensors, handles):
                hvd.synchronize(h)
                assert np.all(t == 2.0 * (SIZE - 1)), "a joined rank must contribute zeros"
        hvd.join()
    hvd.shutdown()


def check_process_set_window() -> None:
    """A process set's backend has a window of its own, released when the set is removed."""
    hvd.init()
    ps = hvd.add_process_set([0, 1])
    if RANK in (0, 1):
        grads = [np.full(100 + i, RANK + 1.0, np.float32) for i in range(4)]
        handles = [hvd.allreduce_async_(g, name=f"ps{i}", op=hvd.Sum, process_set=ps)
                   for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)
        assert all(np.all(g == 3.0) for g in grads), "process set allreduce"
        sets = basics._require().engine._sets
        backend = sets[ps.process_set_id].backend
        assert (backend._node is not None) == bool(backend.fusion_capacity), "window unused"
    hvd.remove_process_set(ps)
    hvd.shutdown()


def hvd_or_none():
    return basics._state


def check_early_shutdown() -> None:
    """Rank 0 stops while the others still run: the cycle that tells them is where the window
    is released, so nobody waits in a collective free for a rank that already left."""
    hvd.init()
    hvd.allreduce(np.ones(100_000, np.float32), name="warm")  # creates the window
    if RANK == 0:
        hvd.shutdown()
    else:
        time.sleep(0.5)
        try:
            hvd.allreduce(np.ones(10, np.float32), name="late")
        except (hvd.HorovodInternalError, ValueError):
            pass
        hvd.shutdown()


def main() -> None:
    node = NodeAllreduce(COMM.Dup(), CAPACITY)
    check_against_mpi(node)
    check_half_sums(node)
    check_staging_under_skew(node)
    check_native_sums_against_mpi(node)
    check_both_ways_under_skew(node)
    node.free()
    check_absent_peer_is_reported()
    check_native_sums_in_rounds()
    check_absent_peer_in_native_sum()
    check_inside_hpc_horovod()
    check_ranks_that_differ_locally()
    check_process_set_window()
    check_early_shutdown()
    print(f"rank {RANK}: node allreduce ok", flush=True)


if __name__ == "__main__":
    sys.exit(main())
