import os
import signal
from pathlib import Path

import pytest

from hpc_horovod.slurm import requeue

WORKERS = Path(__file__).resolve().parent / "workers"


def test_restart_count():
    assert requeue.restart_count({}) == 0
    assert requeue.restart_count({"SLURM_RESTART_COUNT": "2"}) == 2
    with pytest.raises(ValueError, match="SLURM_RESTART_COUNT"):
        requeue.restart_count({"SLURM_RESTART_COUNT": "x"})


def test_requeue_target_is_array_aware():
    assert requeue.requeue_target({"SLURM_JOB_ID": "42"}) == "42"
    assert requeue.requeue_target({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40",
                                   "SLURM_ARRAY_TASK_ID": "3"}) == "40_3"
    with pytest.raises(RuntimeError, match="not in a SLURM job"):
        requeue.requeue_target({})


def test_handler_only_sets_a_flag_and_is_removed():
    previous = signal.getsignal(signal.SIGUSR2)
    stopper = requeue.requeue_on_signal(lambda: None)
    try:
        assert not stopper.signalled
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stopper.signalled and not stopper.stopped
    finally:
        stopper.close()
    assert signal.getsignal(signal.SIGUSR2) == previous
    with pytest.raises(TypeError, match="callable"):
        requeue.requeue_on_signal("save.pt")


@pytest.mark.mpi
def test_ranks_agree_on_the_stop_step(mpirun):
    proc = mpirun(2, WORKERS / "requeue_agreement.py", timeout=120)
    assert proc.stdout.count("stopped at step 6") == 2, proc.stdout


EARLY = """\
import os, signal
import hpc_horovod as hvd
from hpc_horovod.slurm import requeue_on_signal
hvd.init()
os.kill(os.getpid(), signal.SIGUSR2)   # SLURM's signal, before the loop installs its handler
print("alive", flush=True)
stopper = requeue_on_signal(lambda: print("saved", flush=True), requeue=False)
print("stop", stopper.should_stop(), flush=True)
"""


@pytest.mark.parametrize("declared", [True, False])
def test_a_signal_before_requeue_on_signal_is_kept_in_a_job_that_asked_for_it(declared):
    import subprocess
    import sys

    from support import clean_env

    env = clean_env({"HPC_HOROVOD_REQUEUE_SIGNAL": "USR2"} if declared else {})
    proc = subprocess.run([sys.executable, "-c", EARLY], capture_output=True, text=True,
                          timeout=120, env=env)
    if declared:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split("\n")[:3] == ["alive", "saved", "stop True"], proc.stdout
    else:  # no job script asked for it: SIGUSR2 keeps its default action
        assert proc.returncode == -signal.SIGUSR2 and "alive" not in proc.stdout


def test_catch_early_signal_leaves_other_handlers_alone():
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        assert not requeue.catch_early_signal({"HPC_HOROVOD_REQUEUE_SIGNAL": "USR2"})
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        assert not requeue.catch_early_signal({})
        assert requeue.catch_early_signal({"HPC_HOROVOD_REQUEUE_SIGNAL": "USR2"})
    finally:
        signal.signal(signal.SIGUSR2, previous)
