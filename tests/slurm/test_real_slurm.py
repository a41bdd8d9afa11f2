"""Jobs on a real SLURM (the ``slurm`` fixture): generated job scripts, layouts, launch mistakes,
a rank killed mid-training, requeue on SIGUSR2, ``srun hpc-horovod doctor``, and what sbatch
itself makes of the options and times ``hpc-horovod sbatch`` accepts.

The two hosts are network namespaces of this machine; their GPUs are fake device files (there is
no GPU here), so only SLURM's own GPU bookkeeping (``--gres``, ``CUDA_VISIBLE_DEVICES``) is
exercised with them.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_validate import BAD_TIMES, SLURM_TIMES  # a sibling module (pytest's rootdir import)

from hpc_horovod.slurm import render_job, validate

pytestmark = pytest.mark.slurm

WORKERS = Path(__file__).resolve().parent / "workers"
HPC_HOROVOD = [sys.executable, "-m", "hpc_horovod"]


def _job_script(tmp_path: Path, name: str, command: list[str], **options) -> Path:
    """A job script from the generic profile (CPU only, partition debug)."""
    script = render_job(command, cluster="generic", partition="debug", time="00:05:00",
                        job_name=name, modules=[], **options)
    path = tmp_path / f"{name}.sh"
    path.write_text(script)
    return path


def _output(tmp_path: Path, name: str) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob(f"{name}-*.out")))


@pytest.mark.parametrize("nodes, tasks", [(2, 1), (1, 2)])
def test_generated_script_runs_one_rank_per_task(slurm, tmp_path, nodes, tasks):
    script = _job_script(tmp_path, f"layout{nodes}x{tasks}",
                         [sys.executable, str(WORKERS / "check_layout.py")],
                         nodes=nodes, gpus_per_node=0, ntasks_per_node=tasks)
    status, record = slurm.submit_and_wait(script)
    out = _output(tmp_path, f"layout{nodes}x{tasks}")
    assert status == 0, f"{record}\n{out}"
    assert out.count("layout ok") == nodes * tasks, out
    assert "export SRUN_CPUS_PER_TASK=1" in script.read_text()


def test_arguments_reach_every_task_verbatim(slurm, tmp_path):
    nasty = ["x; touch pwned1", "$(touch pwned2)", "`touch pwned3`", "a'b\nc", "*"]
    code = "import json, os, sys; print('ARGS', json.dumps([sys.argv[1:], os.environ['NOTE']]))"
    script = _job_script(tmp_path, "quoting", [sys.executable, "-c", code, *nasty],
                         nodes=1, gpus_per_node=0, ntasks_per_node=2,
                         env={"NOTE": "$(touch pwned4); echo"})
    status, _ = slurm.submit_and_wait(script)
    out = _output(tmp_path, "quoting")
    assert status == 0, out
    seen = [json.loads(line.split(": ARGS ", 1)[1]) for line in out.splitlines()
            if ": ARGS " in line]  # srun --label: each line led by its rank
    assert seen == [[nasty, "$(touch pwned4); echo"]] * 2, out
    assert not list(tmp_path.glob("pwned*"))


def test_modules_load_with_lmod(slurm, tmp_path):
    """The module section of a script under real Lmod: `module` is found even in a batch shell
    that did not inherit it, a module's environment reaches the tasks, a missing one stops the
    job with its name."""
    (tmp_path / "modules" / "hvdtest").mkdir(parents=True)
    (tmp_path / "modules" / "hvdtest" / "1.0.lua").write_text('setenv("HVD_TESTMOD", "on")\n')
    code = "import os; print('TESTMOD', os.environ['HVD_TESTMOD'])"
    env = {"MODULEPATH": str(tmp_path / "modules")}
    good = render_job([sys.executable, "-c", code], cluster="generic", partition="debug",
                      gpus_per_node=0, job_name="withmod", modules=["hvdtest/1.0"])
    assert "module purge\nmodule load hvdtest/1.0 " in good
    (tmp_path / "good.sh").write_text(good)
    status, _ = slurm.submit_and_wait(tmp_path / "good.sh", env=env)
    assert status == 0 and "TESTMOD on" in _output(tmp_path, "withmod"), _output(tmp_path,
                                                                                "withmod")
    bad = render_job([sys.executable, "-c", code], cluster="generic", partition="debug",
                     gpus_per_node=0, job_name="nomod", modules=["hvdtest/9.9"])
    (tmp_path / "bad.sh").write_text(bad)
    status, _ = slurm.submit_and_wait(tmp_path / "bad.sh", env=env)
    out = _output(tmp_path, "nomod")
    assert status == 1 and "module load hvdtest/9.9 failed" in out and "TESTMOD" not in out, out


def test_non_uniform_layout(slurm, tmp_path):
    proc = slurm.run(["srun", "-N", "2", "-n", "3", "--mpi=pmix", "--kill-on-bad-exit=1",
                      sys.executable, str(WORKERS / "check_layout.py"), "2,1"], timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("layout ok") == 3
    assert "local 1/2 node 0/2" in proc.stdout and "local 0/1 node 1/2" in proc.stdout


def test_batch_script_without_srun_names_the_fix(slurm, tmp_path):
    script = tmp_path / "nosrun.sh"
    script.write_text("#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output=nosrun-%j.out\n"
                      f"{sys.executable} {WORKERS / 'batch_without_srun.py'}\n")
    status, record = slurm.submit_and_wait(script)
    out = _output(tmp_path, "nosrun")
    assert status == 3, f"{record}\n{out}"
    assert "BatchScriptWithoutSrunError" in out and "srun python train.py" in out, out


def test_srun_without_mpi_plugin_fails_fast(slurm):
    """Open MPI under --mpi=none cannot wire the tasks: a clear failure, never a hang (the
    run is bounded)."""
    proc = slurm.run(["srun", "-N", "1", "-n", "2", "--mpi=none", sys.executable,
                      str(WORKERS / "check_layout.py")], timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "layout ok" not in out
    assert "--mpi=pmix" in out or "PMI support" in out, out


def test_killed_rank_ends_the_job(slurm, tmp_path):
    """The survivors alone would reduce for a minute more; srun --kill-on-bad-exit=1 must end
    the step as soon as rank 1 dies (the wait is bounded well below that minute)."""
    script = _job_script(tmp_path, "killed", [sys.executable,
                                              str(WORKERS / "train_until_killed.py"), "1"],
                         nodes=2, gpus_per_node=0, ntasks_per_node=1)
    assert "--kill-on-bad-exit=1" in script.read_text()
    status, record = slurm.submit_and_wait(script, timeout=45)
    out = _output(tmp_path, "killed")
    assert status != 0 and record["JobState"] == "FAILED", f"{record}\n{out}"
    assert "rank 1: SIGKILL at step 3" in out, out
    assert "task 1: Killed" in out and "task 0: Terminated" in out, out
    assert "survived" not in out and "allreduce failed" not in out, out


def test_requeue_on_signal_saves_requeues_and_resumes(slurm, tmp_path):
    checkpoint, progress = tmp_path / "checkpoint.json", tmp_path / "progress"
    proc = slurm.run([*HPC_HOROVOD, "sbatch", "--cluster", "generic", "--nodes", "2",
                      "--gpus-per-node", "0", "--partition", "debug", "--time", "00:10:00",
                      "--requeue", "--job-name", "requeue", "--modules", "", "--script", "job.sh",
                      "--submit", "--", sys.executable, str(WORKERS / "train_requeue.py"),
                      str(checkpoint), str(progress)], cwd=tmp_path, check=True)
    job = proc.stdout.strip()
    assert job.isdigit(), proc.stdout
    script = (tmp_path / "job.sh").read_text()
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=USR2@300" in script

    deadline = time.monotonic() + 60
    while not (progress.exists() and progress.read_text().strip().isdigit()
               and int(progress.read_text()) >= 5):
        if time.monotonic() > deadline:
            pytest.fail(f"the job made no progress: {slurm.job_state(job)}\n"
                        f"{_output(tmp_path, 'requeue')}")
        time.sleep(0.2)
    slurm.run(["scancel", "--signal=USR2", job], check=True)
    # The requeued job starts again by itself once its credential has expired (10 s here).
    state = slurm.wait_job(job, 120)
    out = _output(tmp_path, "requeue")
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", f"{state}\n{out}"
    saved = int(out.split("saved checkpoint at step ")[1].split()[0])
    assert saved >= 5
    assert out.count(f"restart 1, starting at step {saved}") == 2, out
    assert f"rank 0: resumed from step {saved}" in out and "SLURM_RESTART_COUNT=1" in out, out
    assert out.count("stopped at step") == 2, out


def _doctor(slurm, *srun_args, timeout=60):
    return slurm.run(["srun", *srun_args, *HPC_HOROVOD, "doctor"], timeout=timeout)


def test_doctor_reports_every_rank(slurm):
    proc = _doctor(slurm, "-N", "2", "--ntasks-per-node=2", "--gres=gpu:2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("hpc_horovod doctor: slurm launch, 4 process(es) on 2 node(s)")
    rows = [line.split() for line in lines[2:6]]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert [r[2] for r in rows] == ["h1", "h1", "h2", "h2"]
    assert [r[3] for r in rows] == ["0/2", "1/2", "0/2", "1/2"]
    assert [r[4] for r in rows] == ["0/2", "0/2", "1/2", "1/2"]
    assert all(r[5] == "1/1" for r in rows), rows  # OMP_NUM_THREADS=1, a CPU per task
    assert all(r[6] == "0,1" for r in rows), rows
    assert lines[-1] == "verdict: ready", proc.stdout


def test_doctor_flags_gpu_mistakes(slurm):
    shared = _doctor(slurm, "-N", "1", "-n", "2", "--gres=gpu:1")
    assert shared.returncode == 1, shared.stdout + shared.stderr
    # a one-node job lands on either node of the test cluster
    assert re.search(r"2 tasks on h[12] share 1 GPU\(s\)", shared.stdout), shared.stdout
    assert "verdict: NOT READY" in shared.stdout

    per_task = _doctor(slurm, "-N", "1", "-n", "2", "--gres=gpu:2", "--gpus-per-task=1")
    assert per_task.returncode == 0, per_task.stdout + per_task.stderr
    assert "torch.cuda.set_device(hvd.local_rank()) fails" in per_task.stdout
    assert "verdict: ready, with 1 warning(s)" in per_task.stdout


def test_doctor_without_mpi_plugin(slurm):
    proc = _doctor(slurm, "-N", "1", "-n", "2", "--mpi=none")
    assert proc.returncode != 0
    assert proc.stdout.count("without an MPI plugin") == 2, proc.stdout + proc.stderr
    assert "srun --mpi=pmix" in proc.stdout


def _slurm_minutes(limit: str) -> int:
    """``scontrol``'s TimeLimit (``[D-]HH:MM:SS``) in minutes."""
    days, _, clock = limit.rpartition("-")
    hours, minutes, _ = (int(x) for x in clock.split(":"))
    return (int(days or 0) * 24 + hours) * 60 + minutes


def test_times_mean_what_sbatch_reads(slurm, tmp_path):
    """Every time format accepted here is one sbatch accepts, with the same limit (SLURM keeps
    whole minutes, rounding seconds up); the strings refused here that sbatch takes are the
    unlimited ones and out-of-range fields, which SLURM carries over silently."""
    for text, seconds in SLURM_TIMES:
        assert validate.parse_time(text) == seconds
        proc = slurm.run(["sbatch", "--parsable", "--hold", "-t", text, "-o", "/dev/null",
                          "--wrap", "true"], cwd=tmp_path, check=True)
        job = proc.stdout.strip().split(";")[0]
        limit = slurm.job_state(job)["TimeLimit"]
        slurm.run(["scancel", job], check=True)
        if seconds == math.inf:
            assert limit == "UNLIMITED", (text, limit)
            continue
        assert _slurm_minutes(limit) == -(-seconds // 60), (text, limit)
        # and the form written into job scripts reads back the same
        assert validate.parse_time(validate.format_time(seconds)) == seconds
    refused = [text for text in BAD_TIMES if slurm.run(
        ["sbatch", "--test-only", "-t", text, "--wrap", "true"], cwd=tmp_path).returncode != 0]
    assert {"20h", "1:2:3:4", ""} <= set(refused), refused


def test_slurm_spellings_pass_sbatch_test_only(slurm, tmp_path):
    (tmp_path / "t.py").write_text("")
    proc = slurm.run([*HPC_HOROVOD, "sbatch", "-N", "2", "--ntasks-per-node", "2", "-c", "1",
                      "-t", "5", "-J", "spelled", "-p", "debug", "-o", "spelled-%j.out",
                      "--signal", "USR2@60", "--requeue", "--mem", "1000M", "--exclusive",
                      "-a", "0-1", "-e", "err-%A_%a.txt", "--mail-type", "END", "-d",
                      "singleton", "--script", "job.sh", "--", "python", "t.py"], cwd=tmp_path,
                     check=True)
    assert proc.stdout == "" and "the tasks run python as" in proc.stderr
    test = slurm.run(["sbatch", "--test-only", "job.sh"], cwd=tmp_path)
    assert test.returncode == 0 and "to start at" in test.stderr and "h[1-2]" in test.stderr, \
        test.stderr
    # a GPU job takes every GPU of the node type by default: the test nodes have 2
    gpus = render_job(["python", "t.py"], cluster="generic", nodes=2, gpus_per_node=2,
                      time="1-0", job_name="gpus")
    test = subprocess.run(["sbatch", "--test-only"], input=gpus, capture_output=True, text=True,
                          env=slurm.env(), cwd=tmp_path, timeout=60)
    assert test.returncode == 0, test.stderr


def test_gpus_means_what_sbatch_means(slurm, tmp_path):
    """-N 2 --gpus 2 is two GPUs for the job, as sbatch's own --gpus 2 (here one per node, so
    that every node runs one task per GPU): the tasks see as many GPUs in all."""
    show = "import os; print('GPUS', os.environ['SLURMD_NODENAME'], " \
           "os.environ.get('CUDA_VISIBLE_DEVICES', ''))"
    ours = slurm.run([*HPC_HOROVOD, "sbatch", "-N", "2", "--gpus", "2", "-t", "5", "-J", "ours",
                      "--submit", "--", "python", "-c", show], cwd=tmp_path, check=True)
    theirs = slurm.run(["sbatch", "--parsable", "-N", "2", "--gpus", "2", "-t", "5", "-J",
                        "theirs", "-o", "theirs-%j.out", "--wrap",
                        f"srun --ntasks-per-node=1 {sys.executable} -c \"{show}\""],
                       cwd=tmp_path, check=True)
    seen = {}
    for name, job in (("ours", ours.stdout.strip()), ("theirs", theirs.stdout.strip())):
        record = slurm.wait_job(job, 60)
        out = _output(tmp_path, name)
        assert record["JobState"] == "COMPLETED", f"{record}\n{out}"
        lines = [line.split("GPUS ", 1)[1].split() for line in out.splitlines() if "GPUS " in line]
        seen[name] = {node: len(gpus[0].split(",")) if gpus else 0 for node, *gpus in lines}
    assert seen["ours"] == {"h1": 1, "h2": 1}, seen
    assert sum(seen["theirs"].values()) == sum(seen["ours"].values()) == 2, seen


@pytest.mark.parametrize("argv, error", [
    (["-p", "gpu"], "-p gpu: no such partition on this cluster (sinfo); it has debug"),
    (["--ntasks-per-node", "64"], "64 CPUs per node, but the nodes of partition debug have 4"),
    (["--gpus-per-node", "3"], "--gpus-per-node 3: the nodes of partition debug have 2 GPU(s)"),
])
def test_generic_jobs_are_checked_against_the_live_cluster(slurm, tmp_path, argv, error):
    """The generic profile knows nothing of this cluster; sinfo does."""
    (tmp_path / "t.py").write_text("")
    proc = slurm.run([*HPC_HOROVOD, "sbatch", *argv, "--script", "job.sh", "--", "python",
                      "t.py"], cwd=tmp_path)
    assert proc.returncode == 2 and error in proc.stderr, proc.stderr
    assert not (tmp_path / "job.sh").exists()
