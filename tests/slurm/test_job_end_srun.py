"""Every failure ends the whole job under ``srun --kill-on-bad-exit=1`` on the test SLURM (two
"nodes", one rank on each): the scenarios of tests/parallel/job_end_worker.py, whose output
must name rank 1, and whose job must end soon after rank 1 fails. Under srun the failing task's
own message comes first, and rank 0 closes with a one-line summary."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from test_job_end import NAMES_RANK_1, STALL_ENV, WORKER, check_job_end  # noqa: E402

pytestmark = pytest.mark.slurm

#: what srun itself says about a task that died of a signal
SRUN_NAMES = {**NAMES_RANK_1, "kill": ["task 1", "Killed"]}


@pytest.mark.parametrize("scenario", sorted(NAMES_RANK_1))
def test_a_failing_rank_ends_the_srun_step(slurm, scenario, monkeypatch, tmp_path):
    monkeypatch.setitem(NAMES_RANK_1, "kill", SRUN_NAMES["kill"])
    mark = tmp_path / "failed_at"
    proc = slurm.run(["srun", "-N", "2", "-n", "2", "--mpi=pmix", "--kill-on-bad-exit=1",
                      sys.executable, str(WORKER), scenario], timeout=250,
                     env={**STALL_ENV, "JOB_END_MARK": str(mark)})
    out = proc.stdout + proc.stderr
    took = check_job_end(scenario, proc.returncode, out, time.time(), mark)
    if scenario not in ("kill", "mismatch"):
        # the failing task's first error is printed before rank 0's report of it
        first = out.index(NAMES_RANK_1[scenario][0])
        assert first <= out.index("job failed:"), out
    print(f"{scenario}: the srun step ended {took:.1f} s after rank 1 failed")
