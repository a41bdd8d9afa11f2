"""``hpc_horovod.slurm.submit`` on the real two-node SLURM of the ``slurm`` fixture, driven the
way a notebook drives it (``workers/notebook_submit.py``): the per-rank results come back, a
rank's exception is raised with its rank, and an interrupt cancels the job."""

from __future__ import annotations

import io
import json
import os
import pty
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hpc_horovod.slurm import submit, submit_array
from hpc_horovod.slurm.remote import Job, _Progress

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


def _between(out: str, job_id: str) -> list[str]:
    """What result() printed: the lines after SUBMITTED up to RESULT."""
    lines = out.split("SUBMITTED ", 1)[1].split("\n", 1)[1]
    return lines.split("RESULT ", 1)[0].split("\n")[:-1]


def test_progress_prints_changes_and_new_lines_once(slurm, tmp_path):
    """To a file or pipe: a line per change of state and per new output line, nothing again."""
    proc = _notebook(slurm, "steps", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = _tagged(proc.stdout, "SUBMITTED").split()[0]
    printed = _between(proc.stdout, job_id)
    states = [line.split(", elapsed ")[0] for line in printed if line.startswith("job ")]
    shown = [line for line in printed if line.startswith("  | ")]
    assert len(states) + len(shown) == len(printed), printed
    assert len(set(states)) == len(states), printed  # each state once
    # a poll may catch the job COMPLETING (its epilog running) between the two: a state too
    ended = [state for state in states if state != f"job {job_id}: COMPLETING"]
    assert ended[-2:] == [f"job {job_id}: RUNNING on h[1-2]", f"job {job_id}: COMPLETED"], printed
    assert shown == ["  | rank 0 of 2 starts on h1", *(f"  | step {k}" for k in range(8))], printed


def test_progress_rewrites_one_line_on_a_terminal(slurm, tmp_path):
    """On a terminal the status line (with its elapsed time) rewrites itself; output lines go
    above it, once each, and only the last status stays."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(NOTEBOOK), "steps", str(tmp_path)],
                            stdout=follower, stderr=subprocess.PIPE, env=slurm.env(),
                            cwd=tmp_path)
    os.close(follower)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        err = proc.communicate(timeout=90)[1]
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = b"".join(chunks).decode().replace("\r\n", "\n")
    assert proc.returncode == 0, out + err.decode()
    job_id = _tagged(out, "SUBMITTED").split()[0]
    printed = _between(out, job_id)
    # each printed line is what is left after its last rewrite
    final = [line.rsplit("\r\x1b[K", 1)[-1] for line in printed]
    assert final[-1].startswith(f"job {job_id}: COMPLETED, elapsed "), final
    assert final[:-1] == ["  | rank 0 of 2 starts on h1", *(f"  | step {k}" for k in range(8))], \
        final
    assert out.count(f"\r\x1b[Kjob {job_id}: RUNNING on h[1-2], elapsed ") >= 3, out


def test_progress_bounds_the_lines_of_one_look(tmp_path):
    """More new lines than ``lines`` in one look: the last ones, after how many were left out."""
    stream = io.StringIO()
    show = _Progress(stream, 2, tmp_path / "output.log")
    show("job 1: RUNNING on h1", "job 1: RUNNING on h1, elapsed 00:00:01", ["a", "b", "c", "d"])
    show("job 1: RUNNING on h1", "job 1: RUNNING on h1, elapsed 00:00:03", [])
    show("job 1: COMPLETED", "job 1: COMPLETED, elapsed 00:00:04", ["e"])
    show.close()
    assert stream.getvalue().splitlines() == [
        "job 1: RUNNING on h1, elapsed 00:00:01",
        f"  | ... 2 more line(s) of rank 0 in {tmp_path / 'output.log'}", "  | c", "  | d",
        "job 1: COMPLETED, elapsed 00:00:04", "  | e"]


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


def test_an_array_of_data_parallel_jobs_found_again_and_cleaned_up(slurm, tmp_path):
    """submit_array: three members of two ranks each, one at a time (``parallel=1``), results
    per member; a second session lists the jobs, attaches to them by id and cleans them up."""
    worker = NOTEBOOK.parent / "array_submit.py"
    first = slurm.run([sys.executable, str(worker), "submit", str(tmp_path)], cwd=tmp_path,
                      timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    ids = json.loads(_tagged(first.stdout, "SUBMITTED"))
    array_id = ids[0].split("_")[0]
    assert ids == [f"{array_id}_{i}" for i in range(3)]
    assert f"job {ids[2]} is PENDING: cancel() it" in _tagged(first.stdout, "REFUSED")
    assert json.loads(_tagged(first.stdout, "FIRST")) == [[1, 0, 2, 30.0], [1, 1, 2, 30.0]]
    (folder,) = (tmp_path / ".hpc_horovod" / "jobs").iterdir()
    assert "#SBATCH --array=0-2%1" in (folder / "job.sh").read_text()

    second = slurm.run([sys.executable, str(worker), "attach", str(tmp_path), *ids[::-1]],
                       cwd=tmp_path, timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    listed = json.loads(_tagged(second.stdout, "LISTED"))
    assert sorted(listed) == [[job_id, str(folder / str(i))] for i, job_id in enumerate(ids)]
    results = json.loads(_tagged(second.stdout, "RESULTS"))
    assert results == [[[seed, rank, 2, seed * 3 * 10.0] for rank in range(2)]
                       for seed in (3, 2, 1)]
    assert not folder.exists()  # the last element's cleanup took the array's folder


def test_attach_names_the_jobs_it_knows(tmp_path):
    from hpc_horovod.slurm import jobs

    assert jobs(tmp_path) == []
    with pytest.raises(ValueError, match=r"no job '42' under .*\(jobs there: none\)"):
        Job.attach(42, tmp_path)
    with pytest.raises(ValueError, match=r"^calls must be a non-empty list of argument tuples"):
        submit_array(print, [], workdir=tmp_path)
    with pytest.raises(ValueError, match=r"^array='0-3': a job array is submit_array"):
        submit(print, array="0-3", workdir=tmp_path)


def test_a_large_payload_is_named_with_what_it_carries(tmp_path):
    """A function from ``__main__`` (as in a notebook) that uses a large global: the warning says
    the payload's size, where it goes, and the global."""
    script = tmp_path / "big.py"
    script.write_text(textwrap.dedent(f"""
        import warnings
        from pathlib import Path
        from hpc_horovod import runner

        runner.PAYLOAD_WARN_BYTES = 2_000_000
        table = b"x" * 3_000_000

        def train(n):
            return len(table) + n

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.write_payload(Path({str(tmp_path)!r}), train, args=(b"y" * 500_000,))
            runner.write_payload(Path({str(tmp_path)!r}), len, args=(b"y" * 100,))
        for w in caught:
            print(w.message)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    (message,) = proc.stdout.splitlines()
    assert message == (f"the payload of 'train' is 4 MB ({tmp_path / 'payload.pkl'}, written "
                       "for every job and read by every rank); it carries global table (used "
                       "by train) 3 MB, args[0] 500 kB: load large data inside the function "
                       "(from a file the nodes see) instead of capturing it"), message
