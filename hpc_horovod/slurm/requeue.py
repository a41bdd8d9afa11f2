"""Stop cleanly before the time limit, save, and requeue the job so that it resumes.

A job script with ``#SBATCH --signal=USR2@300`` (no ``B:``, so every task gets it) and
``#SBATCH --requeue`` gets SIGUSR2 five minutes before its end; the shell of a script that
``hpc-horovod sbatch`` writes passes on to the tasks a SIGUSR2 sent to it alone (``B:``,
``scancel --batch`` or ``--full``). ``requeue_on_signal`` installs a
handler that only sets a flag; the training loop asks ``should_stop()`` at each step boundary,
the ranks agree through an allreduce of their flags (a rank may get the signal a little later
than another), so every rank stops at the same step. Rank 0 then saves the checkpoint and runs
``scontrol requeue``; the job starts again later with ``SLURM_RESTART_COUNT`` one higher and
resumes from the checkpoint::

    stopper = hvd_slurm.requeue_on_signal(lambda: save(model, step))
    for step in range(start, steps):
        if stopper.should_stop():
            break
        train_step()

SIGUSR2 rather than SIGUSR1: NCCL has been known to take SIGUSR1 for itself.

SLURM may send the signal up to a minute before the time asked for, and a requeued job may
have little time left: the signal can come while the job starts, before ``requeue_on_signal``
runs, and SIGUSR2's default action would kill the task. A job script that asks for the signal
(``hpc-horovod sbatch`` writes ``export HPC_HOROVOD_REQUEUE_SIGNAL=USR2``) makes ``hvd.init()``
catch it from then on (:func:`catch_early_signal`); ``requeue_on_signal`` takes over what was
caught.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

#: set by a job script that asks SLURM for SIGUSR2 before the time limit
SIGNAL_ENV = "HPC_HOROVOD_REQUEUE_SIGNAL"


class _Early:
    """SIGUSR2 caught by :func:`catch_early_signal` before a :class:`RequeueOnSignal` exists."""

    signalled = False

    @classmethod
    def handle(cls, signum, frame) -> None:
        cls.signalled = True


def catch_early_signal(env: Mapping[str, str] | None = None) -> bool:
    """In a job whose script sets ``HPC_HOROVOD_REQUEUE_SIGNAL``, catch SIGUSR2 from now on
    (a flag that :func:`requeue_on_signal` takes over) instead of dying of it; True when
    installed. Nothing changes where the signal already has a handler, or off the main thread
    (where Python cannot install one)."""
    env = os.environ if env is None else env
    if env.get(SIGNAL_ENV, "").upper().removeprefix("SIG") not in ("USR2", "12"):
        return False
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, _Early.handle):
        return False
    signal.signal(signal.SIGUSR2, _Early.handle)
    return True


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times SLURM has requeued this job (``SLURM_RESTART_COUNT``, 0 at first)."""
    env = os.environ if env is None else env
    value = env.get("SLURM_RESTART_COUNT", "") or "0"
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"SLURM_RESTART_COUNT={value!r} is not an integer") from None


def requeue_target(env: Mapping[str, str] | None = None) -> str:
    """The id ``scontrol requeue`` needs: ``ARRAYJOB_TASK`` inside a job array, else the job."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if not env.get("SLURM_JOB_ID"):
        raise RuntimeError("not in a SLURM job (no SLURM_JOB_ID): nothing to requeue")
    return env["SLURM_JOB_ID"]


def requeue_job(env: Mapping[str, str] | None = None, timeout: float = 60) -> str:
    """``scontrol requeue`` this job (or array task); returns the id requeued.

    In elastic training (``HOROVOD_ELASTIC_DIR`` set) it then marks the directory as requeued,
    so that the launcher keeps the last commit for the job's next run.
    """
    env = os.environ if env is None else env
    target = requeue_target(env)
    proc = subprocess.run(["scontrol", "requeue", target], capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"scontrol requeue {target} failed: {proc.stderr.strip()} (the job "
                           "needs #SBATCH --requeue, and the site must allow requeueing)")
    if env.get("HOROVOD_ELASTIC_DIR"):
        from ..common.elastic import REQUEUED_FILE

        (Path(env["HOROVOD_ELASTIC_DIR"]) / REQUEUED_FILE).write_text(target + "\n")
    return target


class RequeueOnSignal:
    """The handle :func:`requeue_on_signal` returns; see the module docstring."""

    #: name of the flag allreduce, the same at every step so the engine's cache serves it
    FLAG_NAME = "hpc_horovod.slurm.requeue_flag"

    def __init__(self, save_checkpoint: Callable[[], object], signum: int = signal.SIGUSR2,
                 requeue: bool = True):
        if not callable(save_checkpoint):
            raise TypeError(f"save_checkpoint must be callable, got {save_checkpoint!r}")
        self.save_checkpoint = save_checkpoint
        self.signum = signum
        self.requeue = requeue
        self.stopped = False
        self.requeued: str | None = None
        self._previous = signal.signal(signum, self._handle)
        #: a signal that came before, while catch_early_signal's handler held it
        self.signalled = self._previous == _Early.handle and _Early.signalled
        if self._previous == _Early.handle:
            self._previous = signal.SIG_DFL

    def _handle(self, signum, frame) -> None:
        # Only a flag: the step in progress finishes; the ranks agree on where to stop.
        self.signalled = True

    def should_stop(self) -> bool:
        """Collective (every rank, same step): True once any rank got the signal.

        The first time it returns True, rank 0 has saved the checkpoint, every rank has waited
        for it, and the job has been requeued (when in a SLURM job and ``requeue`` is set).
        """
        import hpc_horovod as hvd

        if self.stopped:
            return True
        flag = np.array([1 if self.signalled else 0], dtype=np.int32)
        if int(hvd.allreduce(flag, op=hvd.Max, name=self.FLAG_NAME)[0]) == 0:
            return False
        self.stopped = True
        if hvd.rank() == 0:
            self.save_checkpoint()
        hvd.barrier()
        if self.requeue and hvd.rank() == 0:
            if os.environ.get("SLURM_JOB_ID"):
                self.requeued = requeue_job()
            else:
                warnings.warn("stopping on signal outside a SLURM job: checkpoint saved, nothing "
                              "to requeue", stacklevel=2)
        return True

    def close(self) -> None:
        """Put back the signal handler that was there before."""
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None

    def __enter__(self) -> RequeueOnSignal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def requeue_on_signal(save_checkpoint: Callable[[], object], signum: int = signal.SIGUSR2,
                      requeue: bool = True) -> RequeueOnSignal:
    """Install the SIGUSR2 handler; returns the object whose ``should_stop()`` the loop asks.

    Call it on every rank after ``hvd.init()``; ``save_checkpoint()`` runs on rank 0 only.
    """
    return RequeueOnSignal(save_checkpoint, signum=signum, requeue=requeue)
