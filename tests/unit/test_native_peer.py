"""The cross-memory sum of ``hpc_horovod._native`` (src_native/peer.c) in one process.

Every "rank" here is this process: its pid is given for each of them, so the kernel's
``process_vm_readv``/``process_vm_writev`` calls are real, only between arrays of one address
space. Running each rank's share one after the other is what the ranks do at once: rank r reads
and writes only its own slice of everyone's tensors. Results are checked bit for bit against
numpy summing in rank order (float16/bfloat16 in float32, rounded once). The parallel version,
between real processes, is tests/parallel/test_peer_allreduce.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from hpc_horovod.backends.shm import _slice_bounds

_native = pytest.importorskip("hpc_horovod._native")

DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16),
          np.dtype(ml_dtypes.bfloat16)]
CHUNK = _native.peer_chunk()


def expected(inputs: list[list[np.ndarray]], i: int, dtype: np.dtype, factor: float):
    """Tensor i summed over the ranks in rank order, in float32 (float64), times factor."""
    acc_type = np.float64 if dtype == np.float64 else np.float32
    acc = inputs[0][i].astype(acc_type)
    for rank_inputs in inputs[1:]:
        acc = acc + rank_inputs[i].astype(acc_type)
    return (acc * acc_type(factor)).astype(dtype)


def run_group(sizes: list[int], dtype: np.dtype, ranks: int, factor: float, in_place: bool,
              seed: int = 0):
    """(inputs, outputs) of every simulated rank after every rank ran its share."""
    rng = np.random.default_rng(seed)
    inputs = [[(rng.standard_normal(n) * 8).astype(dtype) for n in sizes] for _ in range(ranks)]
    originals = [[x.copy() for x in xs] for xs in inputs]
    outputs = inputs if in_place else [[np.full(n, np.nan, dtype) for n in sizes]
                                       for _ in range(ranks)]
    tables = np.empty((ranks, len(sizes), 3), dtype=np.uint64)
    totals = {_native.peer_table(inputs[r], outputs[r], tables[r]) for r in range(ranks)}
    assert totals == {sum(sizes) * dtype.itemsize}
    scratch = np.empty((ranks - 1) * CHUNK, dtype=np.uint8)
    pids = [os.getpid()] * ranks
    for r in range(ranks):
        lo, hi = _slice_bounds(sum(sizes), dtype.itemsize, ranks, r)
        _native.peer_reduce(pids, tables, r, lo * dtype.itemsize, hi * dtype.itemsize,
                            dtype.name, factor, scratch)
    return originals, inputs, outputs


GROUPS = {
    "200 x 16 KiB": [4096] * 200,
    "slices over several chunks": [300_000, 7, 250_000],
    "empty tensors among others": [0, 5, 0, 1000, 0],
    "fewer elements than ranks": [1],
    "more tensors than one call takes": [8] * 2500,  # > 1024 segments per chunk
}


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("group", list(GROUPS))
def test_every_rank_gets_the_rank_order_sum(ranks, dtype, group):
    sizes = GROUPS[group]
    factor = 1.0 if ranks == 2 else 1.0 / ranks
    originals, _, outputs = run_group(sizes, dtype, ranks, factor, in_place=True)
    for i in range(len(sizes)):
        want = expected(originals, i, dtype, factor)
        for r in range(ranks):
            assert outputs[r][i].view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), \
                f"rank {r}, tensor {i} of {group}"


@pytest.mark.parametrize("factor", [0.5, 0.3, 3.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_out_of_place_outputs_and_factors(dtype, factor):
    sizes = [1000, 70_000, 3]
    originals, inputs, outputs = run_group(sizes, dtype, 2, factor, in_place=False)
    for r in range(2):
        for i in range(len(sizes)):
            assert np.array_equal(inputs[r][i].view(np.uint8), originals[r][i].view(np.uint8)), \
                "an out-of-place input was modified"
            want = expected(originals, i, dtype, factor)
            assert outputs[r][i].view(np.uint8).tobytes() == want.view(np.uint8).tobytes()


def test_peer_read_and_write_between_processes():
    """A real second process: read its bytes, write into it, then read them back."""
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import numpy as np, sys\n"
         "a = np.arange(4, dtype=np.int64)\n"
         "print(a.ctypes.data, flush=True)\n"
         "sys.stdin.readline()\n"
         "print(a.tolist(), flush=True)\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = int(child.stdout.readline())
        seen = np.zeros(4, np.int64)
        _native.peer_read(child.pid, address, seen)
        assert seen.tolist() == [0, 1, 2, 3]
        _native.peer_write(child.pid, address + 8, np.array([41, 42], np.int64))
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "[0, 41, 42, 3]"
    finally:
        child.kill()
        child.wait()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def two_rank_tables(peer_address: int | None = None, peer_bytes: int = 4096):
    mine = [np.ones(1024, np.float32)]
    table = np.empty((2, 1, 3), np.uint64)
    _native.peer_table(mine, mine, table[0])
    table[1] = table[0]
    if peer_address is not None:
        table[1, 0, 0] = table[1, 0, 1] = peer_address
    table[1, 0, 2] = peer_bytes
    return mine, table, np.empty(CHUNK, np.uint8)


def test_a_peer_that_cannot_be_read_is_named():
    mine, table, scratch = two_rank_tables(peer_address=8)  # an unmapped address
    with pytest.raises(OSError, match=r"reading rank 1's tensors \(pid \d+\): Bad address"):
        _native.peer_reduce([os.getpid()] * 2, table, 0, 0, 2048, "float32", 1.0, scratch)
    pid = dead_pid()
    mine, table, scratch = two_rank_tables()
    with pytest.raises(OSError, match=rf"reading rank 1's tensors \(pid {pid}\): No such process"):
        _native.peer_reduce([os.getpid(), pid], table, 0, 0, 2048, "float32", 1.0, scratch)
    with pytest.raises(OSError):
        _native.peer_read(pid, 4096, np.zeros(1, np.int64))


def test_bad_arguments_are_refused_before_any_copy():
    mine, table, scratch = two_rank_tables(peer_bytes=4000)
    pids = [os.getpid()] * 2
    with pytest.raises(OSError, match="rank 1's tensor 0 has 4000 bytes, this rank's 4096"):
        _native.peer_reduce(pids, table, 0, 0, 2048, "float32", 1.0, scratch)
    mine, table, scratch = two_rank_tables()
    with pytest.raises(TypeError, match="no sum of int32"):
        _native.peer_reduce(pids, table, 0, 0, 2048, "int32", 1.0, scratch)
    with pytest.raises(ValueError, match=r"bytes \[0, 8192\) of a group of 4096 bytes"):
        _native.peer_reduce(pids, table, 0, 0, 8192, "float32", 1.0, scratch)
    with pytest.raises(ValueError, match=r"bytes \[0, 2046\)"):
        _native.peer_reduce(pids, table, 0, 0, 2046, "float32", 1.0, scratch)
    with pytest.raises(ValueError, match="rank 2 of 2 ranks"):
        _native.peer_reduce(pids, table, 2, 0, 2048, "float32", 1.0, scratch)
    with pytest.raises(ValueError, match="scratch holds 16 bytes"):
        _native.peer_reduce(pids, table, 0, 0, 2048, "float32", 1.0, np.empty(16, np.uint8))
    assert np.all(mine[0] == 1.0)


def test_tables_check_their_arrays():
    table = np.empty((2, 3), np.uint64)
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        _native.peer_table([np.ones(3)] * 2, [np.ones(3)], table)
    with pytest.raises(ValueError, match=r"outputs\[0\] has 16 bytes, its input 24"):
        _native.peer_table([np.ones(3)], [np.ones(2)], table)
    frozen = np.ones(3)
    frozen.flags.writeable = False
    with pytest.raises((ValueError, BufferError), match=r"outputs\[0\] must be a writable"):
        _native.peer_table([np.ones(3)], [frozen], table)
    with pytest.raises((ValueError, BufferError), match=r"outputs\[1\] must be a writable"):
        _native.peer_table([np.ones(3), frozen], [np.ones(3), frozen], table)  # in place
    with pytest.raises(ValueError, match="the table holds 48 bytes, 3 rows need 72"):
        _native.peer_table([np.ones(1)] * 3, [np.ones(1)] * 3, table)
    a = np.arange(6.0)
    assert _native.peer_table([a], [a], table) == 48
    assert table[0].tolist() == [a.ctypes.data, a.ctypes.data, 48]
    b, c = np.arange(2.0), np.empty(2)
    assert _native.peer_table([a, b], [a, c], table) == 64
    assert table.tolist() == [[a.ctypes.data, a.ctypes.data, 48],
                              [b.ctypes.data, c.ctypes.data, 16]]
