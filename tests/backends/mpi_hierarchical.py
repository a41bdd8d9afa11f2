"""Checks of the hierarchical host backend, run by every rank of ``mpirun -np N python -m pytest
tests/backends/mpi_hierarchical.py`` (``test_hierarchical.py`` launches it at 2, 3 and 4 ranks).
Every check is collective: each rank runs the same checks in the same order.

The flat path (``MpiBackend``: one ``MPI_Allreduce``) is the reference: integer results must be
bit-identical, float results equal within one rounding per reduction step."""

from __future__ import annotations

import os
import re
import socket
import time

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from hpc_horovod.backends import hierarchical
from hpc_horovod.backends.mpi import MpiBackend
from hpc_horovod.common.errors import SharedMemoryError
from hpc_horovod.common.types import Max, Min, Product, Sum

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
INTS = [np.int8, np.uint8, np.int16, np.int32, np.int64]
FLOATS = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
COUNTS = [1, 5, 63, 64, 1000, 100_003]


@pytest.fixture(scope="module")
def flat():
    backend = MpiBackend(WORLD.Dup())
    yield backend
    backend.free()


@pytest.fixture(scope="module")
def hier():
    backend = hierarchical.create(WORLD.Dup(), 1 << 20, 30.0, mpi_below_bytes=0)
    yield backend
    backend.close()


def _values(dtype, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + RANK)
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    return rng.standard_normal(count).astype(dtype)


def _both(flat, hier, x: np.ndarray, op: int, pre: float = 1.0, post: float = 1.0):
    a, b = x.copy(), x.copy()
    flat.allreduce(a, op, prescale=pre, postscale=post)
    hier.allreduce(b, op, prescale=pre, postscale=post)
    return a, b


def _ulps(dtype) -> float:
    """One rounding per reduction step, relative: SIZE - 1 steps of the dtype's epsilon."""
    eps = float(ml_dtypes.finfo(dtype).eps)
    return 4 * SIZE * eps


def test_small_messages_go_to_mpi(flat):
    """Below ``mpi_below_bytes`` no arrival happens in the window (MPI's Allreduce); at it, the
    stages run; both equal flat MPI."""
    backend = hierarchical.create(WORLD.Dup(), 1 << 20, 30.0, mpi_below_bytes=4096)
    try:
        for count, staged in ((1023, False), (1024, True), (5000, True)):
            seq = backend.window.seq
            a, b = _both(flat, backend, _values(np.int32, count, 3), Sum, post=1.0 / SIZE)
            assert a.tobytes() == b.tobytes(), count
            assert (backend.window.seq > seq) == staged, count
    finally:
        backend.close()
    assert hierarchical.MPI_BELOW_BYTES > 0


def test_single_host_is_hierarchical(hier):
    assert isinstance(hier, hierarchical.HierarchicalBackend)
    assert hier.local_size == SIZE and hier.cross_size == 1


@pytest.mark.parametrize("dtype", INTS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", [Sum, Min, Max, Product], ids=["sum", "min", "max", "product"])
def test_integers_bit_identical_to_flat(flat, hier, dtype, op):
    for count in COUNTS:
        a, b = _both(flat, hier, _values(dtype, count, count), op)
        assert a.tobytes() == b.tobytes(), (count, a[:8], b[:8])


@pytest.mark.parametrize("dtype", INTS, ids=lambda d: np.dtype(d).name)
def test_integer_average_scaling_bit_identical(flat, hier, dtype):
    x = (_values(np.int8, 5000, 7).astype(np.int64) // 4).astype(dtype)
    a, b = _both(flat, hier, x, Sum, pre=1.0, post=1.0 / SIZE)
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_integral_floats_bit_identical(flat, hier, dtype):
    x = (np.arange(100_003) % 17 + RANK).astype(dtype)
    a, b = _both(flat, hier, x, Sum)
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (1.0, None), (0.5, None), (1 / 3, 3.0)],
                         ids=["sum", "average", "prescaled-average", "pre-post"])
def test_floats_within_one_rounding(flat, hier, dtype, scales):
    pre, post = scales
    post = 1.0 / SIZE if post is None else post
    for count in COUNTS:
        a, b = _both(flat, hier, _values(dtype, count, count), Sum, pre, post)
        wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)
        scale = np.abs(_values(dtype, count, count).astype(np.float64)).max() * SIZE * pre * post
        assert np.all(np.abs(wide_a - wide_b) <= _ulps(dtype) * max(scale, 1e-30)), count
        if SIZE == 2:  # two values: one rounding either way, the same
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("op", [Min, Max], ids=["and", "or"])
def test_bool(flat, hier, op):
    x = _values(np.uint8, 1000, 3) % 2 == 0
    a, b = _both(flat, hier, x, op)
    assert a.tobytes() == b.tobytes()


def test_out_of_place(flat, hier):
    x = _values(np.float32, 300_001, 11)
    a, b = np.empty_like(x), np.full_like(x, np.nan)
    flat.allreduce(a, Sum, send=x, prescale=0.5, postscale=1.0 / SIZE)
    hier.allreduce(b, Sum, send=x, prescale=0.5, postscale=1.0 / SIZE)
    np.testing.assert_allclose(a, b, rtol=_ulps(np.float32), atol=1e-6)
    assert np.array_equal(x, _values(np.float32, 300_001, 11)), "the input changed"


@pytest.mark.parametrize("window", [64 << 10, 1024, 0], ids=["64k", "1k", "0"])
def test_chunks_of_a_small_window(flat, window):
    """Tensors many times the staging half go in chunks; a window below a page (a small
    HOROVOD_FUSION_THRESHOLD, or 0) still gets a page per half."""
    small = hierarchical.create(WORLD.Dup(), window, 30.0, mpi_below_bytes=0)
    try:
        for count in (8191, 8192, 100_001):
            for dtype in (np.int32, np.int64):
                a, b = _both(flat, small, _values(dtype, count, 5), Sum)
                assert a.tobytes() == b.tobytes(), (count, dtype)
    finally:
        small.close()


def test_bucket_memory_in_place(flat, hier):
    """A buffer in the window (every rank's, or only some ranks') is reduced where it lies."""
    x = _values(np.int64, 4000, 9)
    ref = x.copy()
    flat.allreduce(ref, Sum)
    memory = hier.bucket_memory(x.nbytes)
    assert memory is not None
    for in_window in (True, RANK % 2 == 0):
        buf = memory.view(np.int64) if in_window else np.empty_like(x)
        buf[...] = x
        hier.allreduce(buf, Sum)
        assert buf.tobytes() == ref.tobytes()
    assert hier.bucket_memory(1 << 40) is None


@pytest.fixture
def small(monkeypatch):
    """A hierarchical backend of 64 KiB segments whose chunks are 4 KiB (512 int64s), every
    size through the window."""
    monkeypatch.setattr(hierarchical, "CHUNK_BYTES", 4096)
    backend = hierarchical.create(WORLD.Dup(), 64 << 10, 30.0, mpi_below_bytes=0)
    yield backend
    backend.close()


def _window_memory(backend, where: str, nbytes: int) -> np.ndarray:
    """``nbytes`` of the window: a bucket's (``bucket_memory``) or the fused groups'
    (``fusion_memory``, in the staging half)."""
    memory = getattr(backend, f"{where}_memory")(nbytes)
    assert memory is not None, where
    return memory


def test_fusion_memory_in_the_staging_half(hier):
    """The fused groups' memory: past the first cache line of the staging half (offset 0 is a
    staged first chunk's), the same at every call, none beyond the half or once closed."""
    win = hier.window
    first, again = hier.fusion_memory(4096), hier.fusion_memory(100)
    assert win.offset_of(first) == win.offset_of(again) == hierarchical.ALIGN
    assert hier.fusion_memory(win.staging_bytes - hierarchical.ALIGN) is not None
    assert hier.fusion_memory(win.staging_bytes - hierarchical.ALIGN + 1) is None
    assert MpiBackend.fusion_memory(hier, 4096) is None  # the flat path has none
    closed = hierarchical.create(WORLD.Dup(), 64 << 10, 30.0)
    closed.close()
    assert closed.fusion_memory(64) is None


@pytest.mark.parametrize("where", ["bucket", "fusion"])
def test_chunks_in_and_out_of_the_window_in_turn(flat, small, where):
    """Several chunks, with the data in the window (a bucket, or the fused groups' memory) on
    some ranks and staged on the others, and calls back to back (odd and even numbers of
    chunks): the two staging halves and the two slots of published offsets never mix up a
    peer's data."""
    chunk = 4096 // 8
    memory = _window_memory(small, where, 4 * chunk * 8)
    for seed, count in enumerate((3 * chunk - 5, 4 * chunk, 1, chunk + 1, 2 * chunk + 3)):
        for in_window in (RANK == 0, RANK % 2 == 1, True, False):
            x = _values(np.int64, count, seed)
            ref = x.copy()
            flat.allreduce(ref, Sum)
            buf = memory.view(np.int64)[:count] if in_window else np.empty_like(x)
            buf[...] = x
            small.allreduce(buf, Sum)
            assert buf.tobytes() == ref.tobytes(), (count, in_window)
            y = _values(np.int32, count, seed).astype(np.float64)  # exact sums and scales
            a = np.empty_like(y)
            flat.allreduce(a, Sum, send=y, prescale=0.5, postscale=0.25)
            b = memory.view(np.float64)[:count] if in_window else np.empty_like(y)
            b[...] = y
            small.allreduce(b, Sum, prescale=0.5, postscale=0.25)
            assert b.tobytes() == a.tobytes(), (count, in_window)


@pytest.mark.parametrize("where", ["bucket", "fusion", "both"])
def test_data_in_the_window_everywhere_goes_in_two_arrivals(flat, small, where):
    """Data in the window on every rank (buckets, the fused groups' memory, or some ranks'
    bucket and the others' fusion memory): the first arrival shows it, and all of it goes as
    one chunk (two arrivals whatever the size); data staged on one rank keeps one arrival per
    chunk."""
    chunk = 4096 // 8
    if where == "both":
        where = "bucket" if RANK % 2 else "fusion"
    memory = _window_memory(small, where, 5 * chunk * 8)
    for count, in_window, arrivals in ((5 * chunk - 3, True, 2), (chunk, True, 2),
                                       (5 * chunk - 3, RANK != SIZE - 1, 6)):
        x = _values(np.int64, count, count)
        ref = x.copy()
        flat.allreduce(ref, Sum)
        buf = memory.view(np.int64)[:count] if in_window else np.empty_like(x)
        buf[...] = x
        before = small.window.seq
        small.allreduce(buf, Sum, postscale=1.0)
        assert buf.tobytes() == ref.tobytes(), (count, in_window)
        assert small.window.seq - before == arrivals, (count, in_window)


#: Splits of the ranks into "nodes" (ranks per node) for each number of ranks: equal and unequal
LAYOUTS = {2: [(1, 1)], 3: [(2, 1), (1, 2), (1, 1, 1)], 4: [(2, 2), (3, 1), (1, 2, 1)],
           5: [(3, 2), (2, 3), (2, 2, 1)]}


def test_layouts_bit_identical_to_flat(flat, monkeypatch):
    """Ranks in groups ("nodes") of any sizes: the groups share this host's memory, so the
    window is real; only the split is chosen here. Equal groups reduce each slice across groups,
    unequal ones go through each group's leader; integers match flat MPI bit for bit."""
    for layout in LAYOUTS[SIZE]:
        node_of = [g for g, n in enumerate(layout) for _ in range(n)]
        comm = WORLD.Dup()
        node = comm.Split(color=node_of[RANK], key=RANK)
        backend = hierarchical.HierarchicalBackend(comm, node, 256 << 10, 30.0,
                                                   mpi_below_bytes=0)
        try:
            assert backend.cross_size == len(layout), layout
            assert backend.local_size == layout[node_of[RANK]], layout
            assert backend.by_slice == (len(set(layout)) == 1), layout
            for dtype, op in ((np.int32, Sum), (np.uint8, Sum), (np.int16, Max),
                              (np.int64, Product), (np.int8, Min)):
                for count in (1, 77, 70_001):
                    a, b = _both(flat, backend, _values(dtype, count, count), op)
                    assert a.tobytes() == b.tobytes(), (layout, dtype, op, count)
            x = _values(np.int32, 50_000, 4) // 4
            a, b = np.empty_like(x), np.full_like(x, -1)
            flat.allreduce(a, Sum, send=x, postscale=1.0 / SIZE)
            backend.allreduce(b, Sum, send=x, postscale=1.0 / SIZE)
            assert a.tobytes() == b.tobytes(), layout
            x = x[:20_000].copy()  # within the window's half that holds buckets
            memory = backend.bucket_memory(x.nbytes).view(np.int32)
            memory[...] = x
            # post-scaled: a leader's result in its bucket is scaled once every rank read it
            flat.allreduce(x, Sum, postscale=1.0 / SIZE)
            backend.allreduce(memory, Sum, postscale=1.0 / SIZE)
            assert memory.tobytes() == x.tobytes(), layout
            # in buckets on the first group only, in five chunks: every group cuts the same ones
            y = _values(np.int32, x.size, 6) // 4
            ref = y.copy()
            flat.allreduce(ref, Sum)
            buf = memory if node_of[RANK] == 0 else np.empty_like(y)
            buf[...] = y
            with monkeypatch.context() as patch:
                patch.setattr(hierarchical, "CHUNK_BYTES", 16 << 10)
                backend.allreduce(buf, Sum)
            assert buf.tobytes() == ref.tobytes(), layout
            x = _values(np.float32, 50_000, 2)
            a, b = _both(flat, backend, x, Sum, 0.5, 1.0 / SIZE)
            np.testing.assert_allclose(a, b, rtol=_ulps(np.float32), atol=1e-6)
            x = (np.arange(1001) % 9 + RANK).astype(np.float16)
            a, b = _both(flat, backend, x, Sum)
            assert a.tobytes() == b.tobytes(), layout
            del memory
        finally:
            backend.close()


def test_process_set(flat, hier):
    ranks = [0, SIZE - 1]
    sub = hier.sub(ranks)
    assert (sub is not None) == (RANK in ranks)
    if sub is None:
        return
    try:
        assert isinstance(sub, hierarchical.HierarchicalBackend)
        x = np.full(1000, RANK + 1, np.int32)
        sub.allreduce(x, Sum)
        assert np.all(x == 1 + SIZE)
    finally:
        sub.close()


@pytest.mark.parametrize("nwords", [2, 3, 18, 2, 17])
def test_negotiation_is_the_bitwise_and_of_every_rank(hier, nwords):
    """Through the window on one node: the same words as MPI's AND, negotiation after
    negotiation (the slots alternate) and whatever the number of words."""
    rng = np.random.default_rng([RANK, nwords])
    words = rng.integers(0, 1 << 63, nwords, dtype=np.uint64) | np.uint64(0x8000_0000_0000_F00F)
    expected = words.copy()
    WORLD.Allreduce(MPI.IN_PLACE, expected, op=MPI.BAND)
    for _ in range(3):
        got = words.copy()
        hier.negotiate(got, 30.0)
        assert got.tolist() == expected.tolist()


def test_negotiation_longer_than_the_window_is_refused(hier):
    with pytest.raises(ValueError, match="1000 negotiation words, the window holds 24"):
        hier.negotiate(np.zeros(1000, np.uint64), 30.0)


def test_a_wait_that_leaves_its_core_blocks_until_the_last_peer_arrives(hier, monkeypatch):
    """With no thread waiting for a result, a wait for peers sleeps in the kernel, without
    looking again and again, and the last peer's arrival wakes it at once (not after the
    longest sleep, made 20 s here)."""
    monkeypatch.setattr(hierarchical, "BLOCK_S", 20.0, raising=False)
    late = SIZE - 1
    WORLD.Barrier()
    if RANK == late:
        time.sleep(1.0)
        arrived = time.monotonic()
        hier.window.arrive(0, "a test")
    else:
        cpu = time.thread_time()
        hier.window.arrive(0, "a test")
        cpu, woke = time.thread_time() - cpu, time.monotonic()
    arrived = WORLD.bcast(arrived if RANK == late else None, root=late)
    if RANK != late:
        assert woke - arrived < 1.0, f"woken {woke - arrived:.3f} s after the arrival"
        assert cpu < 0.03, f"{cpu * 1e3:.1f} ms of CPU in a wait of one second"


def test_a_rank_waiting_in_the_window_keeps_mpi_moving():
    """Open MPI moves a rank's messages only inside its MPI calls. Rank 0 waits in the window
    while its eager sends are still queued (a collective it has left may leave it so); rank 1
    must receive them all before it comes: rank 0's wait keeps MPI moving, or neither ends
    before the peer timeout."""
    backend = hierarchical.create(WORLD.Dup(), 1 << 20, 10.0)
    count, payload = 20_000, np.arange(1 << 10, dtype=np.int32).view(np.uint8)[:1 << 10]
    try:
        WORLD.Barrier()
        start = time.monotonic()
        if RANK == 0:
            requests = [WORLD.Isend(payload, dest=1, tag=77) for _ in range(count)]
            try:
                backend.window.arrive(0, "a test")
            finally:
                MPI.Request.Waitall(requests)
        elif RANK == 1:
            time.sleep(0.5)  # rank 0 waits in the window by now
            received = np.empty_like(payload)
            for _ in range(count):
                WORLD.Recv(received, source=0, tag=77)
            assert np.array_equal(received, payload)
            backend.window.arrive(0, "a test")
        else:
            backend.window.arrive(0, "a test")
        elapsed = time.monotonic() - start
        assert elapsed < 6.0, f"{elapsed:.1f} s"
    finally:
        backend.close()


def test_ranks_that_cannot_wake_each_other_are_refused(monkeypatch):
    """Ranks that share memory but not a network namespace cannot reach each other's wake
    sockets (made so here: the last rank binds another name): every rank refuses the window,
    naming who cannot reach whom and the switch."""
    if RANK == SIZE - 1:
        class Elsewhere(socket.socket):
            def bind(self, address):
                super().bind(address + b"-elsewhere")

        monkeypatch.setattr(socket, "socket", Elsewhere)
    with pytest.raises(SharedMemoryError) as info:
        hierarchical.create(WORLD.Dup(), 1 << 20, 30.0)
    text = str(info.value)
    assert f"rank 0 of this node cannot reach the wake socket of its local rank {SIZE - 1}" \
        in text, text
    assert "HOROVOD_HIERARCHICAL_ALLREDUCE=0" in text


def test_window_too_large_fails_with_size_limit_and_switch():
    with pytest.raises(SharedMemoryError) as info:
        hierarchical.create(WORLD.Dup(), 1 << 50, 30.0)
    text = str(info.value)
    assert f"({SIZE} ranks x {1 << 50} bytes" in text, text
    assert hierarchical.backing_directory() in text
    assert "HOROVOD_HIERARCHICAL_ALLREDUCE=0" in text


def test_segment_file_unlinked():
    """The window's file is gone once every rank mapped it: a rank that dies leaves nothing."""
    directory = hierarchical.backing_directory()
    before = set(os.listdir(directory))
    backend = hierarchical.create(WORLD.Dup(), 1 << 20, 30.0)
    WORLD.Barrier()
    host = MPI.Get_processor_name()
    try:
        new = [n for n in set(os.listdir(directory)) - before if "osc" in n and host in n]
        assert new == []
    finally:
        backend.close()


def test_close_keeps_memory_with_live_views():
    backend = hierarchical.create(WORLD.Dup(), 1 << 20, 30.0)
    view = backend.bucket_memory(4096) if RANK == 0 else None
    backend.close()
    if RANK == 0:
        view[:] = 7  # still mapped: the window was retired, not freed
    assert backend.window.win is None
    freed = hierarchical.create(WORLD.Dup(), 1 << 20, 30.0)
    freed.bucket_memory(4096)
    retained = len(hierarchical._retained)
    freed.close()  # no view left on any rank: freed collectively
    assert len(hierarchical._retained) == retained
    assert freed.bucket_memory(4096) is None  # a bucket laid out later goes to private memory


def test_close_without_a_peer_gives_up_naming_it(caplog):
    """A rank that does not come to close within the peer timeout is named, and the window
    retired: nobody hangs, and the late rank, finding the others gone, retires it too."""
    backend = hierarchical.create(WORLD.Dup(), 1 << 20, 2.0)
    late = SIZE - 1
    with caplog.at_level("WARNING", logger="hpc_horovod"):
        if RANK != late:
            backend.close()
        WORLD.Barrier()
        if RANK == late:
            backend.close()
    assert backend.window.win is None
    named = re.search(r"rank\(s\) ([\d, ]+) did not arrive", caplog.text)
    assert named, caplog.text
    absent = {int(r) for r in named.group(1).split(",")}
    assert (absent == set(range(SIZE - 1))) if RANK == late else (late in absent), caplog.text


@pytest.mark.parametrize("which", ["flat", "hier"])
def test_agree_decides_once_at_rank_0(flat, hier, which):
    backend = flat if which == "flat" else hier
    calls = []

    def decide(objs):
        calls.append(len(objs))
        return {"objs": objs, "decided_by": RANK}

    for round_ in range(3):
        # lists of different lengths on each rank, one of them large, one empty
        mine = [("name", RANK, i) for i in range(RANK * 7 + round_)] if RANK != 1 else []
        if RANK == SIZE - 1 and round_ == 1:
            mine.append("x" * 200_000)
        got = backend.agree(mine, decide, 30.0)
        want = [[("name", r, i) for i in range(r * 7 + round_)] if r != 1 else []
                for r in range(SIZE)]
        if round_ == 1:
            want[SIZE - 1].append("x" * 200_000)
        assert got == {"objs": want, "decided_by": 0}
    assert calls == ([SIZE] * 3 if RANK == 0 else [])
