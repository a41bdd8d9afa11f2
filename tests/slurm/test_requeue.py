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
