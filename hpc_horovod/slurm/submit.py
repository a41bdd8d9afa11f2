"""Submit a job script with ``sbatch`` and return its job id; make the directories its output
files go to."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path


def sbatch(script: str | None = None, path: str | os.PathLike | None = None,
           timeout: float = 120) -> str:
    """``sbatch --parsable`` the file at ``path``, or ``script`` text on stdin; the job id."""
    if (script is None) == (path is None):
        raise ValueError("sbatch() takes the script text or the path of a script file")
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise RuntimeError("sbatch is not on PATH: submit from a SLURM login node (or write the "
                           "script with --script FILE and copy it there)")
    cmd = [sbatch, "--parsable"] + ([os.fspath(path)] if path is not None else [])
    proc = subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id:
        raise RuntimeError(f"sbatch printed no job id: {proc.stdout!r} {proc.stderr!r}")
    return job_id


def output_directories(patterns: Iterable[tuple[str, str | None]], workdir: Path) -> list[Path]:
    """Make the directories of the job's output files (``("--output", "logs/%j.out")``: logs,
    under ``workdir`` where relative) and return those made: SLURM makes none, and a job whose
    output file cannot be opened fails at launch and leaves no log anywhere. A directory whose
    name holds a SLURM pattern (``logs/%x/out``, a new one for each job) is refused."""
    made = []
    for flag, pattern in patterns:
        if pattern is None:
            continue
        parent = (workdir / Path(pattern).expanduser()).parent
        if parent.is_dir():
            continue
        if "%" in str(parent):
            raise ValueError(f"{flag} {pattern}: SLURM makes no directory for the job's output, "
                             f"and this one's name holds a pattern ({parent.name}): put the "
                             "patterns in the file's name, in a directory that exists")
        try:
            parent.mkdir(parents=True)
        except OSError as exc:
            raise ValueError(f"{flag} {pattern}: cannot make its directory {parent} ({exc}); "
                             "SLURM makes none") from None
        made.append(parent)
    return made
