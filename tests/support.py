"""Helpers shared by the test packages. Parallel tests run real MPI processes:
``run_mpi(n, script)`` starts ``mpirun -np n python script`` and fails the test with every
rank's output when any rank fails or the job does not finish in time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mpi_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        # Two cores: keep MPI from spinning on shared memory while ranks share a core.
        "OMPI_MCA_mpi_yield_when_idle": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    })
    # Unbuffered output makes print() two writes, and --tag-output then glues the next line's
    # tag to the text ("1.0e-03[1,0]<stdout>:"): workers flush whole lines instead.
    for key in [k for k in env if k.startswith(("SLURM_", "OMPI_COMM_WORLD", "PMI_"))
                or k == "PYTHONUNBUFFERED"]:
        env.pop(key)
    if extra:
        env.update(extra)
    return env


def run_mpi(n: int, script, *args, timeout: float = 180, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` (a path) on ``n`` MPI ranks; return the finished process."""
    cmd = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", "--tag-output",
           sys.executable, "-X", "faulthandler", str(script), *map(str, args)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=mpi_env(env), cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"mpirun -np {n} {script} did not finish in {timeout} s\n{out}\n{err}")
    if check and proc.returncode != 0:
        pytest.fail(f"mpirun -np {n} {script} exited with {proc.returncode}\n"
                    f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    return proc
