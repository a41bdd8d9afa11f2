"""``hpc_horovod.slurm.submit`` on the real two-node SLURM of the ``slurm`` fixture, driven the
way a notebook drives it (``workers/notebook_submit.py``): the per-rank results come back, a
rank's exception is raised with its rank, and an interrupt cancels the job."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpc_horovod.slurm.remote import Job

pytestmark = pytest.mark.slurm

NOTEBOOK = Path(__file__).resolve().parent / "workers" / "notebook_submit.py"


def _notebook(slurm, mode: str, tmp_path: Path, timeout: float = 90):
    return slurm.run([sys.executable, str(NOTEBOOK), mode, str(tmp_path)], cwd=tmp_path,
                     timeout=timeout)


def _tagged(out: str, tag: str):
    line = next(line for line in out.splitlines() if line.startswith(tag + " "))
    return line[len(tag) + 1:]


def test_results_come_back_by_rank(slurm, tmp_path):
    proc = _notebook(slurm, "ok", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(_tagged(proc.stdout, "RESULT"))
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["total"] == 30.0 for r in results)  # (1 + 2) * 10 on every rank
    assert {r["node"] for r in results} == {"h1", "h2"}
    job_id = _tagged(proc.stdout, "SUBMITTED").split()[0]
    # progress: the state, the elapsed time and rank 0's own lines
    assert f"job {job_id}: RUNNING on h[1-2], elapsed " in proc.stdout, proc.stdout
    assert "  | rank 0 of 2 starts on h1" in proc.stdout, proc.stdout
    assert "rank 1 of 2" not in proc.stdout  # only rank 0's output is shown
    folder = next((tmp_path / ".hpc_horovod" / "jobs").iterdir())
    assert "#SBATCH --nodes=2" in (folder / "job.sh").read_text()
    assert "1: rank 1 of 2 starts on h2" in (folder / "output.log").read_text()


def test_a_raising_rank_is_raised_with_its_rank(slurm, tmp_path):
    proc = _notebook(slurm, "raise", tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    message, notes = json.loads(_tagged(proc.stdout, "RAISED"))
    assert message == "rank 1 refuses"
    assert notes[0].startswith("raised on rank 1 of 2"), notes
    assert ", in train\n" in notes[0] and notes[0].endswith("ValueError: rank 1 refuses"), notes
    assert slurm.run(["squeue", "-h"], check=True).stdout.strip() == ""


def test_interrupt_cancels_the_job(slurm, tmp_path):
    proc = subprocess.Popen([sys.executable, str(NOTEBOOK), "sleep", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=slurm.env(), cwd=tmp_path)
    try:
        seen = []
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("  | step 2"):
                break
            assert time.monotonic() < deadline, "".join(seen)
        job_id = _tagged("".join(seen), "SUBMITTED").split()[0]
        assert slurm.job_state(job_id)["JobState"] == "RUNNING"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, out + err
    assert f"job {job_id}: cancelled" in out
    assert slurm.run(["squeue", "-h"], check=True).stdout.strip() == ""
    assert slurm.job_state(job_id)["JobState"] == "CANCELLED"


def test_submit_checks_before_writing(tmp_path):
    from hpc_horovod.slurm import submit

    with pytest.raises(ValueError, match="^time '20h' is not a SLURM time"):
        submit(print, time="20h", workdir=tmp_path)
    with pytest.raises(TypeError, match="cannot be pickled"):
        submit(print, args=(threading.Lock(),), workdir=tmp_path)
    assert list((tmp_path / ".hpc_horovod" / "jobs").iterdir()) == []
    assert repr(Job("12", tmp_path, 2)).startswith("Job('12', 2 task(s)")


def test_a_job_slurm_forgot_is_judged_by_its_results(tmp_path, monkeypatch):
    """Once scontrol no longer knows the job, the rank files alone give the result."""
    from hpc_horovod import runner

    job = Job("999999", tmp_path, 2)
    monkeypatch.setattr(Job, "record", lambda self: {})
    for rank in range(2):
        data = runner._outcome_bytes(rank, True, rank * 10, "")
        runner.atomic_write(runner.rank_file(tmp_path, rank), lambda fh, d=data: fh.write(d))
    assert job.result(progress=False) == [0, 10]
    runner.rank_file(tmp_path, 1).unlink()
    with pytest.raises(RuntimeError, match="(?s)no longer in SLURM's records.*without a result: 1"):
        job.result(progress=False)


def test_run_inside_an_allocation_uses_srun(slurm, tmp_path):
    script = tmp_path / "alloc.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"
                      "#SBATCH --output=alloc-%j.out\n"
                      f"{sys.executable} {NOTEBOOK.parent / 'run_in_allocation.py'}\n")
    status, record = slurm.submit_and_wait(script)
    out = "".join(p.read_text() for p in tmp_path.glob("alloc-*.out"))
    assert status == 0, f"{record}\n{out}"
    assert "+ srun --ntasks=2 --mpi=pmix" in out, out
    ranks = json.loads(out.split("RUN ", 1)[1].splitlines()[0])
    assert ranks == [["x", 0, 2, "h1", True], ["x", 1, 2, "h2", True]], out
