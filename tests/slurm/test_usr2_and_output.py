"""Generated jobs on the real-hosts SLURM (the ``slurm`` fixture): SIGUSR2 sent to the batch
shell, whichever of SLURM's ways sends it, ends in a checkpoint and a requeue; output reaches
the job's file as it is printed; a GPU partition gets GPUs; sbatch reads the values of its own
options as ``hpc-horovod sbatch`` checks them.

The jobs of each test run side by side (one node and two tasks each), so that each test waits
for its slowest job only.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from hpc_horovod.slurm import options
from hpc_horovod.slurm.job import plan_job

pytestmark = pytest.mark.slurm

WORKERS = Path(__file__).resolve().parent / "workers"
HPC_HOROVOD = [sys.executable, "-m", "hpc_horovod"]
#: what one job of the test asks for: one node of the test cluster, two tasks, no GPU
ONE_NODE = ["--nodes", "1", "--ntasks-per-node", "2", "--gpus-per-node", "0", "--partition",
            "debug", "--modules", ""]


def _wait(predicate, what: str, timeout: float, slurm, job: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s: {slurm.job_state(job)}")
        time.sleep(0.2)


def _progress(path: Path) -> int:
    text = path.read_text().strip() if path.exists() else ""
    return int(text) if text.isdigit() else 0


#: how each job gets SIGUSR2 once it trains: the sbatch options it is submitted with, and the
#: command that signals it
WAYS = {
    "full": ([], lambda job: ["scancel", "-s", "USR2", "--full", job]),
    "batch": ([], lambda job: ["scancel", "-s", "USR2", "--batch", job]),
    # the form site pages show, 60 s before the limit: brought within reach by a shorter limit
    # (the signal comes at SLURM's next check of the time limits, every 30 s)
    "b-signal": (["--signal=B:USR2@60"],
                 lambda job: ["scontrol", "update", f"JobId={job}", "TimeLimit=2"]),
}


def test_usr2_to_the_batch_shell_ends_in_a_checkpoint_and_a_requeue(slurm, tmp_path):
    jobs = {}
    for way, (sbatch_options, _) in WAYS.items():
        folder = tmp_path / way
        folder.mkdir()
        slurm.run([*HPC_HOROVOD, "sbatch", *ONE_NODE, "--time", "00:10:00", "--requeue",
                   "--job-name", way, "--script", "job.sh", "--", sys.executable,
                   str(WORKERS / "train_requeue.py"), str(folder / "checkpoint.json"),
                   str(folder / "progress")], cwd=folder, check=True)
        proc = slurm.run(["sbatch", "--parsable", *sbatch_options, "job.sh"], cwd=folder,
                         check=True)
        jobs[way] = proc.stdout.strip().split(";")[0]
    for way, (_, signal) in WAYS.items():
        folder, job = tmp_path / way, jobs[way]
        _wait(lambda folder=folder: _progress(folder / "progress") >= 5, f"{way}: training",
              60, slurm, job)
        slurm.run(signal(job), check=True)
    # the run after the requeue has its 10 minutes again: no signal then
    _wait(lambda: slurm.job_state(jobs["b-signal"])["Restarts"] == "1", "b-signal: requeued",
          60, slurm, jobs["b-signal"])
    slurm.run(["scontrol", "update", f"JobId={jobs['b-signal']}", "TimeLimit=10"], check=True)
    for way, job in jobs.items():
        # the requeued job starts again by itself once its credential has expired (10 s here)
        state = slurm.wait_job(job, 150)
        out = "\n".join(p.read_text() for p in (tmp_path / way).glob(f"{way}-*.out"))
        assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", \
            f"{way}: {state}\n{out}"
        saved = int(out.split("saved checkpoint at step ")[1].split()[0])
        assert saved >= 5, f"{way}\n{out}"
        assert out.count(f"restart 1, starting at step {saved}") == 2, f"{way}\n{out}"
        assert out.count("stopped at step") == 2, f"{way}\n{out}"


def _lateness(paths: dict[str, Path], slurm, jobs: dict[str, str],
              timeout: float = 60) -> dict[str, list[float]]:
    """For each job's output file, the seconds between each ``tick I TIME`` line's print and
    its arrival there: the files are read in turn every 0.1 s, since the jobs run at once."""
    seen: dict[str, dict[int, float]] = {name: {} for name in paths}
    deadline = time.monotonic() + timeout
    while any(len(ticks) < 5 for ticks in seen.values()):
        for name, path in paths.items():
            now = time.time()
            text = path.read_text() if path.exists() else ""
            for i, printed in re.findall(r"tick (\d) ([\d.]+)", text):
                seen[name].setdefault(int(i), now - float(printed))
            if time.monotonic() > deadline:
                pytest.fail(f"{path.name}: {sorted(seen[name])} after {timeout} s: "
                            f"{slurm.job_state(jobs[name])}\n{text}")
        time.sleep(0.1)
    return {name: [ticks[i] for i in range(5)] for name, ticks in seen.items()}


def test_output_reaches_the_file_as_it_is_printed(slurm, tmp_path):
    """A line a second, printed without flush: in the file within 2 s, both from a generated
    job (which exports PYTHONUNBUFFERED) and from a script of the user's own whose tasks call
    hvd.init(); the directory of -o is made for the job."""
    unbuffered = {"PYTHONUNBUFFERED": ""}  # the test cluster's own environment sets it
    generated = slurm.run([*HPC_HOROVOD, "sbatch", *ONE_NODE, "--time", "5", "--job-name",
                           "ticks", "-o", "logs/%x-%j.out", "--submit", "--", "python",
                           str(WORKERS / "print_each_second.py")], cwd=tmp_path, check=True,
                          env=unbuffered)
    assert "made" in generated.stderr and (tmp_path / "logs").is_dir(), generated.stderr
    by_hand = tmp_path / "by-hand.sh"
    by_hand.write_text(f"#!/bin/bash\n#SBATCH -N 1 -n 2 -t 5 -o by-hand-%j.out\n"
                       f"srun {sys.executable} {WORKERS / 'print_each_second.py'} --init\n")
    submitted = slurm.run(["sbatch", "--parsable", str(by_hand)], cwd=tmp_path, check=True,
                          env=unbuffered)
    jobs = {"generated": generated.stdout.strip(), "by-hand": submitted.stdout.strip()}
    files = {"generated": tmp_path / "logs" / f"ticks-{jobs['generated']}.out",
             "by-hand": tmp_path / f"by-hand-{jobs['by-hand']}.out"}
    late = _lateness(files, slurm, jobs)
    for name, job in jobs.items():
        assert max(late[name][:4]) < 2, \
            f"{name}: each line arrived {late[name]} s after its print\n" \
            f"{files[name].read_text()}"
        assert slurm.wait_job(job, 60)["JobState"] == "COMPLETED"


def test_a_gpu_partition_gets_gpus_or_asks_for_them(slurm, tmp_path):
    """A profile whose GPU partition does not know its GPUs per node (as Oscar's gpu): asked
    for none, the job is refused; asked for two, its tasks see them."""
    clusters = tmp_path / "clusters.toml"
    clusters.write_text('[mixed]\nbased_on = "generic"\ndefault = "debug"\n'
                        '[mixed.partitions.debug]\nhas_gpus = true\n')
    env = {"HPC_HOROVOD_CLUSTERS": str(clusters)}
    show = "import os; print('GPUS', os.environ.get('CUDA_VISIBLE_DEVICES', 'none'))"
    command = [*HPC_HOROVOD, "sbatch", "--cluster", "mixed", "-N", "1", "-t", "5", "-J", "gpus",
               "--modules", ""]
    with pytest.raises(ValueError, match="partition debug of cluster mixed has GPUs, a number"):
        plan_job(["python", "-c", show], cluster="mixed", profile_env=env)
    proc = slurm.run([*command, "--gpus-per-node", "2", "--submit", "--", "python", "-c", show],
                     cwd=tmp_path, env=env, check=True)
    job = proc.stdout.strip()
    assert slurm.wait_job(job, 60)["JobState"] == "COMPLETED"
    out = (tmp_path / f"gpus-{job}.out").read_text()
    assert sorted(re.findall(r"GPUS (\S+)", out)) == ["0,1", "0,1"], out


#: values hpc-horovod sbatch refuses, each refused by sbatch too, as (Python name, value)
REFUSED = [("mem", "lots"), ("dependency", "bogus"), ("mail_type", "NEVER"),
           ("nodelist", "h[1-"), ("mem_per_cpu", "2X")]
#: values it passes, each one sbatch takes
PASSED = [("mem", "100M"), ("dependency", "singleton"), ("array", "0-3%2"),
          ("mail_type", "END,FAIL"), ("nodelist", "h[1-2]"), ("exclude", "h1"),
          ("mem_per_cpu", "100")]


def test_sbatch_reads_the_values_as_they_are_checked(slurm, tmp_path):
    """What is refused here sbatch refuses too (the array spec 0-3%x is refused here although
    sbatch --test-only takes it), and what passes, sbatch takes."""
    for name, value in REFUSED + [("array", "0-3%x")]:
        with pytest.raises(ValueError, match=re.escape(f"'{value}'")):
            options.passthrough({name: value})
    for name, value in REFUSED:
        flag = options.PASSTHROUGH[name].directive
        theirs = slurm.run(["sbatch", "--test-only", f"{flag}={value}", "-t", "5", "--wrap",
                            "true"], cwd=tmp_path)
        assert theirs.returncode != 0, (flag, value, theirs.stderr)
    for name, value in PASSED:
        ((flag, written),) = options.passthrough({name: value})
        theirs = slurm.run(["sbatch", "--test-only", f"{flag}={written}", "-t", "5", "--wrap",
                            "true"], cwd=tmp_path)
        assert theirs.returncode == 0, (flag, value, theirs.stderr)
