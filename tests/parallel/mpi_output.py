"""Reading the output of ``mpirun --tag-output``: each rank's stdout and stderr, reassembled."""

from __future__ import annotations

import re
import subprocess

_TAG = re.compile(r"\[\d+,(\d+)\]<(?:stdout|stderr)>:")


def by_rank(proc: subprocess.CompletedProcess) -> dict[int, str]:
    """Rank -> everything it printed. mpirun tags every chunk a rank writes, so chunks of
    several ranks may share a line; untagged text (mpirun's own messages) is left out."""
    out: dict[int, str] = {}
    for stream in (proc.stdout, proc.stderr):
        parts = _TAG.split(stream or "")
        for rank, chunk in zip(parts[1::2], parts[2::2]):
            out[int(rank)] = out.get(int(rank), "") + chunk
    return out


def launcher_text(proc: subprocess.CompletedProcess) -> str:
    """What mpirun itself printed (its lines carry no rank tag)."""
    lines = (proc.stdout + "\n" + proc.stderr).splitlines()
    return "\n".join(line for line in lines if not _TAG.search(line))


def assert_every_rank_says(proc: subprocess.CompletedProcess, ranks: int, text: str) -> None:
    """Every rank printed ``rank <r>: <text>`` (a worker's last line once its checks passed)."""
    for rank in range(ranks):
        assert f"rank {rank}: {text}" in proc.stdout, proc.stdout + proc.stderr
