"""Elastic training in a requeued SLURM job: ``hpc-horovod sbatch --min-nodes 1 --requeue`` on
the test cluster's two hosts (conftest.py), requeued in the middle of an epoch: from outside
(``scontrol requeue``: SLURM ends the launcher and its step) or by the ranks themselves on
SLURM's signal (``requeue_on_signal``: they end well, the launcher keeps the commit). While the
job waits to run again its last commit stays in
``$SLURM_SUBMIT_DIR/.hpc_horovod/elastic/$SLURM_JOB_ID``; the requeued run resumes from it, so
each epoch's samples are committed exactly once over both runs, every rank ends with the same
parameters, the directory is removed at the good end and no step is left in squeue."""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "torch" / "elastic_worker.py"
HPC_HOROVOD = [sys.executable, "-m", "hpc_horovod"]


def _wait_for(condition, what: str, slurm, job: str, out: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            text = out.read_text() if out.exists() else "(no output yet)"
            pytest.fail(f"{what}: not within {timeout} s: {slurm.job_state(job)}\n{text}\n"
                        f"{slurm.logs()}")
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["scontrol requeue", "requeue_on_signal"])
def test_a_requeued_job_resumes_from_its_last_commit(slurm, tmp_path, how):
    pytest.importorskip("torch")
    logs = tmp_path / "logs"
    logs.mkdir()
    proc = slurm.run([*HPC_HOROVOD, "sbatch", "--cluster", "generic", "--nodes", "2",
                      "--ntasks-per-node", "1", "--gpus-per-node", "0", "--partition", "debug",
                      "--time", "00:10:00", "--min-nodes", "1", "--requeue", "--job-name",
                      "elastic-requeue", "--modules", "", "--script", "job.sh", "--submit", "--",
                      sys.executable, str(WORKER), str(logs), "--kill-size", "2", "--hold",
                      *(["--stop-on-signal"] if how == "requeue_on_signal" else [])],
                     cwd=tmp_path, check=True)
    job = proc.stdout.strip()
    assert job.isdigit(), proc.stdout
    script = (tmp_path / "job.sh").read_text()
    assert "#SBATCH --requeue" in script and "#SBATCH --no-kill" in script, script
    assert "run --min-np 1 --max-np 2 -np 2" in script, script
    out = tmp_path / f"elastic-requeue-{job}.out"
    commit = tmp_path / ".hpc_horovod" / "elastic" / job / "commit.pkl"

    # both ranks wait in epoch 1 of the first run, past a commit: requeue the job there
    _wait_for(lambda: len(list(logs.glob("held-*"))) == 2, "both ranks held", slurm, job, out)
    assert commit.exists()
    (logs / "killed").write_text(repr(time.time()))
    if how == "scontrol requeue":
        slurm.run(["scontrol", "requeue", job], check=True)
    else:  # SLURM's signal before the time limit: the ranks stop, rank 0 requeues the job
        slurm.run(["scancel", "--signal=USR2", job], check=True)
    _wait_for(lambda: slurm.job_state(job)["JobState"] == "PENDING", "the job pending again",
              slurm, job, out)
    assert commit.exists(), "the commit of a requeued job must stay for its next run"

    # the requeued job starts again by itself once its credential has expired (10 s here)
    state = slurm.wait_job(job, 120)
    text = out.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", f"{state}\n{text}"
    again = re.search(r"training again ([\d.]+) s after the kill, at 2 ranks", text)
    assert again, text
    print(f"\nrequeued by {how}: training again {again.group(1)} s after the requeue")
    assert "restarting" not in text, text  # a requeue is no elastic reset
    lines = [line for path in logs.glob("committed-*") for line in path.read_text().splitlines()]
    counts = Counter(tuple(map(int, line.split())) for line in lines)
    assert set(counts.values()) == {1}, counts
    assert sorted(counts) == [(e, i) for e in range(3) for i in range(48)]
    finals = {p.name: p.read_text() for p in logs.glob("final-*")}
    assert sorted(finals) == ["final-0", "final-1"] and len(set(finals.values())) == 1
    assert not commit.parent.exists()
    steps = slurm.run(["squeue", "--steps", "-h", "-j", job]).stdout.strip()
    assert steps == "", steps
