"""``hpc_horovod.checkpoint.atomic_write``, the one atomic write of checkpoints and modulefiles."""

from __future__ import annotations

import os

import pytest

from hpc_horovod.checkpoint import atomic_write


def test_writes_and_replaces(tmp_path):
    target = tmp_path / "sub" / "file.lua"
    assert atomic_write(target, lambda fh: fh.write(b"one"), mode=0o644) == target
    assert target.read_bytes() == b"one" and (target.stat().st_mode & 0o777) == 0o644
    atomic_write(target, lambda fh: fh.write(b"two"))
    assert target.read_bytes() == b"two"
    assert os.listdir(target.parent) == ["file.lua"]


def test_a_failed_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "ckpt"
    target.write_bytes(b"old")

    def half(fh):
        fh.write(b"ne")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, half)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["ckpt"]
