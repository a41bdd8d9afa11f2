"""Atomic rank-0 checkpoints: complete files only, newest wins, leftovers of a killed writer are
ignored, other ranks write nothing."""

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest

from hpc_horovod.checkpoint import (
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
)


def test_save_and_resume_newest(tmp_path):
    for step in (1, 2, 10):
        save_checkpoint(lambda f, s=step: pickle.dump({"step": s}, f), str(tmp_path), step,
                        rank=0)
    latest = latest_checkpoint(str(tmp_path))
    assert checkpoint_step(latest) == 10
    with open(latest, "rb") as fh:
        assert pickle.load(fh) == {"step": 10}


def test_keep_removes_oldest(tmp_path):
    for step in range(5):
        save_checkpoint(lambda f: f.write(b"x"), str(tmp_path), step, keep=2, rank=0)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [3, 4]


def test_other_ranks_write_nothing(tmp_path):
    assert save_checkpoint(lambda f: f.write(b"x"), str(tmp_path), 1, rank=1) is None
    assert not os.listdir(tmp_path)


def test_failed_writer_leaves_previous_checkpoint(tmp_path):
    save_checkpoint(lambda f: f.write(b"good"), str(tmp_path), 1, rank=0)

    def broken(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(broken, str(tmp_path), 2, rank=0)
    assert checkpoint_step(latest_checkpoint(str(tmp_path))) == 1
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-00000001.ckpt"]


def test_killed_writer_is_ignored(tmp_path):
    """SIGKILL in the middle of a write: the half-written file never counts as a checkpoint."""
    save_checkpoint(lambda f: f.write(b"good"), str(tmp_path), 1, rank=0)
    script = textwrap.dedent(f"""
        import os, signal
        from hpc_horovod.checkpoint import save_checkpoint
        def write(f):
            f.write(b"partial")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        save_checkpoint(write, {str(tmp_path)!r}, 2, rank=0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert any(name.endswith(".tmp") for name in os.listdir(tmp_path))
    assert checkpoint_step(latest_checkpoint(str(tmp_path))) == 1


def test_missing_directory_has_no_checkpoint(tmp_path):
    assert latest_checkpoint(str(tmp_path / "nope")) is None
    with pytest.raises(ValueError, match="not a checkpoint"):
        checkpoint_step("model.pt")
