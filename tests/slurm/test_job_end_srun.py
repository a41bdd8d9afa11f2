"""Every failure ends the whole job under ``srun --kill-on-bad-exit=1`` on the test SLURM (two
"nodes", one rank on each): the scenarios of tests/parallel/job_end_worker.py, whose output
must name rank 1, and whose job must end soon after rank 1 fails. Under srun the failing task's
own message comes first, and rank 0 closes with a one-line summary."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from test_job_end import NAMES_RANK_1, STALL_ENV, WORKER, check_job_end  # noqa: E402
from test_stuck import BOUND_S as STUCK_BOUND_S  # noqa: E402
from test_stuck import ENV as STUCK_ENV  # noqa: E402
from test_stuck import WORKER as STUCK_WORKER  # noqa: E402
from test_stuck import summary  # noqa: E402

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


@pytest.mark.parametrize("kill_on_bad_exit", [1, 0])
def test_a_rank_frozen_inside_an_allreduce_ends_the_srun_step(slurm, tmp_path, kill_on_bad_exit):
    """A scenario of tests/parallel/test_stuck.py under srun: rank 1 stops itself inside the
    allreduce's data call and rank 0's watch names it. With ``--kill-on-bad-exit=1`` srun kills
    the stopped task once rank 0 exits; without it (SLURM's default) srun would wait for the
    stopped task until the time limit, so rank 0 cancels its step on the way out."""
    proc = slurm.run(["srun", "-N", "2", "-n", "2", "--mpi=pmix",
                      f"--kill-on-bad-exit={kill_on_bad_exit}",
                      sys.executable, STUCK_WORKER, "allreduce", "1"], timeout=250,
                     env={**STUCK_ENV, "STUCK_DIR": str(tmp_path)})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "not stopped" not in out, out
    assert summary(2, "allreduce") in out, out
    took = time.time() - float((tmp_path / "frozen_at").read_text())
    assert took < STUCK_BOUND_S, f"{took:.1f} s\n{out}"
    if not kill_on_bad_exit:
        assert re.search(r"ending step \d+\.\d+ \(scancel\)", out), out
    print(f"--kill-on-bad-exit={kill_on_bad_exit}: the srun step ended {took:.1f} s after "
          "rank 1 froze")
