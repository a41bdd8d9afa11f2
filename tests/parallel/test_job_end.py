"""Every failure ends the whole job under ``hpc-horovod run`` (mpirun): whatever goes wrong on
rank 1, every rank exits soon, the launcher reports non-zero, and the output names rank 1 and
its first error (job_end_worker.py; tests/slurm/test_job_end_srun.py runs the same scenarios
under srun). The time from rank 1's failure to the launcher's exit is bounded loosely on
purpose: the scenarios end in seconds (the stall after its 8 s limit), a busy machine may take
longer, and a rank that does not stop goes on for 300 s."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ROOT, mpi_env

pytestmark = pytest.mark.mpi
WORKER = Path(__file__).parent / "job_end_worker.py"
STALL_ENV = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "8"}

#: scenario -> what the job's output must say about rank 1
NAMES_RANK_1 = {
    "kill": ["process rank 1", "exited on signal 9"],
    "stall": ["Missing ranks:\n", "1: [after.", "job failed: rank(s) 1 stalled"],
    "exception": ["ValueError: rank 1 fails on purpose",
                  "job failed: rank 1 failed first: ValueError: rank 1 fails on purpose"],
    "mismatch": ["Mismatched ALLREDUCE tensor shapes",
                 "[tensor 'shapes.differ': rank 0 vs rank 1]"],
    "exit": ["Rank(s) 1 called shutdown while this rank still runs",
             "job failed: rank(s) 1 finished"],
    "join_allgather": ["Allgather is not supported with Join at this time.",
                       "job failed: rank 1 failed first: HorovodInternalError: Allgather"],
    "join_broadcast": ["Broadcast is not supported with Join at this time.",
                       "job failed: rank 1 failed first: HorovodInternalError: Broadcast"],
}


#: seconds from rank 1's failure to the end of the job, at most (the stall: from its start)
BOUND_S = {"stall": 60.0}
DEFAULT_BOUND_S = 40.0


def untagged(text: str) -> str:
    """mpirun's output without its ``[1,r]<stream>:`` tags (which may split a line)."""
    return re.sub(r"\[1,\d+\]<std(?:out|err)>:", "", text)


def check_job_end(scenario: str, returncode: int, out: str, ended_at: float,
                  mark: Path) -> float:
    """The job failed, named rank 1 as expected and ended in time; returns the seconds from
    rank 1's failure (the time it wrote into ``mark``) to the end of the job."""
    assert returncode != 0, out
    assert "not stopped" not in out, out
    for text in NAMES_RANK_1[scenario]:
        assert text in out, f"{text!r} missing from:\n{out}"
    took = ended_at - float(mark.read_text())
    assert took < BOUND_S.get(scenario, DEFAULT_BOUND_S), f"{took:.1f} s\n{out}"
    return took


@pytest.mark.parametrize("scenario", sorted(NAMES_RANK_1))
def test_a_failing_rank_ends_the_job(scenario, tmp_path):
    cmd = [sys.executable, "-m", "hpc_horovod.cli", "run", "-np", "2", sys.executable,
           str(WORKER), scenario]
    mark = tmp_path / "failed_at"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=250, cwd=ROOT,
                          env=mpi_env({**STALL_ENV, "JOB_END_MARK": str(mark)}))
    took = check_job_end(scenario, proc.returncode, untagged(proc.stdout + proc.stderr),
                         time.time(), mark)
    print(f"{scenario}: the job ended {took:.1f} s after rank 1 failed")
