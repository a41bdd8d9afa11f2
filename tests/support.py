"""Helpers shared by the test packages. Parallel tests run real MPI processes:
``run_mpi(n, script)`` starts ``mpirun -np n python script`` and fails the test with every
rank's output when any rank fails or the job does not finish in time."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: variables that make ``init`` join a launcher's job instead of starting one of size 1
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "HOROVOD_", "TORCHELASTIC_")


def clean_env(extra: dict | None = None) -> dict:
    """This environment without any launcher's variables, with this checkout first on
    PYTHONPATH, and ``extra`` on top: a subprocess started with it runs as a job of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def leave_launchers(monkeypatch) -> None:
    """Remove every launcher's variables for this test: ``init`` starts a job of size 1."""
    for key in [k for k in os.environ if k.startswith(LAUNCHER_PREFIXES)]:
        monkeypatch.delenv(key)


@contextlib.contextmanager
def single_process_job(hvd, monkeypatch):
    """``hvd`` initialized as a job of size 1 (no MPI), shut down afterwards whatever the test
    did."""
    leave_launchers(monkeypatch)
    hvd.shutdown()
    hvd.init()
    try:
        yield hvd
    finally:
        hvd.shutdown()


def without_letting_go_of_the_gil(fn: Callable):
    """``fn()``, failing the test if it lets another Python thread run: a submission that
    releases the GIL lets the engine thread run a cycle in the middle of a batch of gradients.
    The switch interval is raised so that no forced switch happens meanwhile, and the garbage
    collector is off: a collection may finalize what earlier tests left (a torch tensor's
    deallocation can let go of the GIL), which is not the call's doing."""
    turns, stop = [0], threading.Event()

    def other_thread() -> None:
        while not stop.is_set():
            turns[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    thread = threading.Thread(target=other_thread)
    try:
        thread.start()
        time.sleep(0.001)  # the control: a call that lets go of the GIL lets the thread run
        before = turns[0]
        assert before > 0
        gc.disable()
        result = fn()
        assert turns[0] == before, "the call let another thread run: it released the GIL"
    finally:
        gc.enable()
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    return result


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
