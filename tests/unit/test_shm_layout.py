"""The shared window's layout rules (``backends/shm.py``), without MPI processes: segment sizes,
the slices each rank reduces, and the /dev/shm check that keeps a full tmpfs from killing a job."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from hpc_horovod.backends import shm


@pytest.mark.parametrize("ranks", [2, 3, 4, 8, 16, 64, 256])
def test_segments_shrink_with_ranks_and_keep_the_window_bounded(ranks):
    capacity = shm.capacity_for(ranks)
    assert capacity % 64 == 0
    assert 1 << 20 <= capacity <= 16 << 20
    window = 2 * (ranks + 1) * capacity
    assert window <= max(shm.WINDOW_BUDGET, 2 * (ranks + 1) * (1 << 20))


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 1000, 4097, 1 << 20])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("ranks", [1, 2, 3, 7])
def test_slices_cover_the_buffer_once_on_cache_line_bounds(count, itemsize, ranks):
    bounds = [shm._slice_bounds(count, itemsize, ranks, r) for r in range(ranks)]
    covered = []
    for lo, hi in bounds:
        assert 0 <= lo <= hi <= count
        if lo < count:
            assert (lo * itemsize) % 64 == 0, "a slice starts inside a cache line"
        covered.extend(range(lo, hi))
    assert covered == list(range(count))


def test_a_full_dev_shm_turns_the_window_off(monkeypatch):
    capacity = shm.capacity_for(2)
    needed = 2 * 2 * (2 + 1) * capacity
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(
        f_bavail=(needed - 4096) // 4096, f_frsize=4096))
    assert not shm.NodeAllreduce.fits_on_node(capacity, 2)
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(
        f_bavail=needed // 4096 + 1, f_frsize=4096))
    assert shm.NodeAllreduce.fits_on_node(capacity, 2)
