"""Checkpoints that a killed job can never leave half-written.

Only rank 0 writes. The file is written under a temporary name in the same directory, flushed to
disk, then renamed over its final name (``os.replace`` is atomic on POSIX), so a reader sees
either the previous complete checkpoint or the new complete one. Resuming picks the newest
complete checkpoint; temporary leftovers of a killed writer are ignored.

The payload is written by a function you pass (``torch.save``, ``pickle.dump``, ...), so this
module works with every framework::

    save_checkpoint(lambda f: torch.save(state, f), "ckpt", step=epoch)
    path = latest_checkpoint("ckpt")   # None on a fresh start
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_NAME = re.compile(r"^(?P<prefix>.+)-(?P<step>\d+)\.ckpt$")


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object], *,
                 mode: int | None = None) -> Path:
    """Write the file ``path`` through ``write(binary_file)`` so that a reader sees the previous
    file or the new one, never part of one, even if this process is killed.

    The data goes to a temporary file in the same directory, is flushed to disk, and the file
    is renamed over ``path``; the directory is then synced so that the rename survives a
    crash. ``mode`` sets the permissions (default: the temporary file's 0600).
    """
    path = Path(path)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def checkpoint_path(directory: str, step: int, prefix: str = "checkpoint") -> str:
    return os.path.join(directory, f"{prefix}-{step:08d}.ckpt")


def save_checkpoint(write: Callable[[BinaryIO], object], directory: str, step: int,
                    prefix: str = "checkpoint", keep: int = 3,
                    rank: int | None = None) -> str | None:
    """Write a checkpoint atomically on rank 0; return its path (None on other ranks).

    ``keep`` newest checkpoints are kept, older ones removed after the new one is complete.
    """
    if rank is None:
        from .common.basics import is_initialized
        from .common.basics import rank as current_rank

        rank = current_rank() if is_initialized() else 0
    if rank != 0:
        return None
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    final = checkpoint_path(directory, step, prefix)
    atomic_write(final, write)
    if keep > 0:
        for _, old in list_checkpoints(directory, prefix)[:-keep]:
            os.unlink(old)
    return final


def list_checkpoints(directory: str, prefix: str = "checkpoint") -> list[tuple[int, str]]:
    """Complete checkpoints in ``directory``, oldest first, as (step, path)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        if match and match.group("prefix") == prefix:
            found.append((int(match.group("step")), os.path.join(directory, name)))
    return sorted(found)


def latest_checkpoint(directory: str, prefix: str = "checkpoint") -> str | None:
    """The newest complete checkpoint, or None when there is none."""
    found = list_checkpoints(directory, prefix)
    return found[-1][1] if found else None


def checkpoint_step(path: str) -> int:
    match = _NAME.match(os.path.basename(path))
    if not match:
        raise ValueError(f"{path} is not a checkpoint written by save_checkpoint")
    return int(match.group("step"))
