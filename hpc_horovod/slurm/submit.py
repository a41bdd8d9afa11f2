"""Submit a job script with ``sbatch`` and return its job id."""

from __future__ import annotations

import os
import shutil
import subprocess


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
