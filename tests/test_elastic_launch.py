"""The elastic launcher's pieces (``hpc_horovod/elastic_launch.py``): the bounds it accepts,
the launcher command lines of an elastic attempt, the records it reads, and horovodrun's
elastic flags on a real run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT, mpi_env

from hpc_horovod import cli, horovodrun
from hpc_horovod.elastic_launch import Elastic, elastic_directory, read_outcome
from hpc_horovod.launch import Launch, build_command


@pytest.mark.parametrize("bounds, np_, why", [
    ((3, 4), 2, "1 <= --min-np <= -np <= --max-np"),
    ((1, 2), 3, "1 <= --min-np <= -np <= --max-np"),
    ((0, 2), 2, "1 <= --min-np"),
])
def test_bounds_out_of_order_are_refused(bounds, np_, why):
    with pytest.raises(ValueError, match=why.replace("+", r"\+")):
        Elastic(*bounds).check(np_)
    with pytest.raises(ValueError, match="--reset-limit must be >= 0"):
        Elastic(1, 2, reset_limit=-1).check(2)


def test_run_defaults_the_bounds_to_np_and_needs_min_np_for_the_other_flags(capsys):
    args = cli.build_parser().parse_args(["run", "-np", "3", "--max-np", "4", "python", "x"])
    assert Elastic.from_args(args) == Elastic(3, 4, None, 600.0)
    assert cli.main(["run", "-np", "2", "--reset-limit", "1", "python", "x"]) == 2
    assert "--reset-limit needs --min-np" in capsys.readouterr().err


def test_an_elastic_attempt_lets_survivors_end_by_themselves():
    mpirun = build_command(Launch(np=2, command=("python", "x"), elastic=True), {}, cores=2)
    assert "--enable-recovery" in mpirun
    assert "--enable-recovery" not in build_command(Launch(np=2, command=("python", "x")), {},
                                                    cores=2)
    env = {"SLURM_JOB_ID": "7"}
    srun = build_command(Launch(np=4, command=("python", "x"), elastic=True,
                                exclude=("n2", "n3"), nodes=2), env)
    assert srun == ["srun", "--ntasks=4", "--mpi=pmix", "--kill-on-bad-exit=0", "--label",
                    "--exclude=n2,n3", "--nodes=2", "python", "x"]


def test_the_commit_directory_is_the_jobs_inside_slurm(tmp_path):
    launch = Launch(np=2, command=("x",))
    assert elastic_directory(launch, {"HOROVOD_ELASTIC_DIR": str(tmp_path)}) == (tmp_path,
                                                                                 False)
    directory, owned = elastic_directory(launch, {"SLURM_JOB_ID": "41",
                                                  "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert directory == tmp_path / ".hpc_horovod" / "elastic" / "41" and owned
    with pytest.raises(ValueError, match="needs HOROVOD_ELASTIC_DIR: a directory every host"):
        elastic_directory(Launch(np=2, command=("x",), hosts="a:1,b:1"), {})


def test_ranks_without_a_record_are_the_lost_ones(tmp_path):
    assert read_outcome(tmp_path) is None
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    (ranks / "world.json").write_text(json.dumps({"hosts": ["a", "a", "b", "b"]}))
    for rank, status in ((0, "restart"), (1, "restart")):
        (ranks / f"{rank}.json").write_text(json.dumps({"status": status}))
    outcome = read_outcome(tmp_path)
    assert outcome.lost == [2, 3] and outcome.with_status("restart") == [0, 1]


@pytest.mark.mpi
def test_horovodrun_elastic_flags_run_the_elastic_launcher(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os, hpc_horovod.torch as hvd\nhvd.init()\n"
                      "@hvd.elastic.run\ndef train(state):\n    state.commit()\n"
                      "    print('DIR', os.environ['HOROVOD_ELASTIC_DIR'], flush=True)\n"
                      "train(hvd.elastic.ObjectState(epoch=0))\n")
    proc = subprocess.run([sys.executable, "-m", "hpc_horovod.horovodrun", "--min-np", "1",
                           "--max-np", "2", "--reset-limit", "2", "--elastic-timeout", "30",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=mpi_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dirs = {line.split()[-1] for line in proc.stdout.splitlines() if "DIR " in line}
    assert len(dirs) == 1, proc.stdout
    assert proc.stdout.count("DIR ") == 2  # -np defaults to --max-np
    assert not Path(dirs.pop()).exists(), "a default directory is removed after a good end"
    assert shutil.which("mpirun")


def test_horovodrun_parses_the_elastic_flags():
    args = horovodrun.build_parser().parse_args(["--min-np", "2", "--max-np", "4",
                                                 "--reset-limit", "3", "--elastic-timeout",
                                                 "60", "python", "x"])
    assert (args.min_np, args.max_np, args.reset_limit, args.elastic_timeout) == (2, 4, 3, 60)


REQUEUING = """\
import os, sys
from pathlib import Path
import hpc_horovod.torch as hvd
from hpc_horovod.common.elastic import REQUEUED_FILE
hvd.init()
@hvd.elastic.run
def train(state):
    print("from epoch", state.epoch, flush=True)
    while state.epoch < 4:
        state.epoch += 1
        state.commit()
        if state.epoch == 2 and sys.argv[1] == "requeue":
            if hvd.rank() == 0:  # what requeue_job marks once scontrol requeue succeeded
                Path(os.environ["HOROVOD_ELASTIC_DIR"], REQUEUED_FILE).write_text("7\\n")
            return
train(hvd.elastic.ObjectState(epoch=0))
"""


@pytest.mark.mpi
def test_a_run_that_requeued_its_job_keeps_the_commit_for_the_next_run(tmp_path):
    """Ranks that stop because they requeued their job end well: the job's directory stays,
    and the job's next run resumes from it, then removes it."""
    script = tmp_path / "train.py"
    script.write_text(REQUEUING)
    env = mpi_env({"SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path)})
    directory = tmp_path / ".hpc_horovod" / "elastic" / "7"

    def run(mode):
        return subprocess.run([sys.executable, "-m", "hpc_horovod.cli", "run", "--no-srun",
                               "--min-np", "1", "-np", "2", sys.executable, str(script), mode],
                              capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    first = run("requeue")
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"the job was requeued: its next run resumes from the last commit, which stays in " \
        f"{directory}" in first.stderr, first.stderr
    assert (directory / "commit.pkl").exists() and (directory / "requeued").exists()
    second = run("train")
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("from epoch 2") == 2, second.stdout
    assert not directory.exists(), "the directory of a job that ended well is removed"
