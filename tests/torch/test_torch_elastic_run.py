"""Elastic training on real processes: ``hpc-horovod run --min-np 2 --max-np 3 -np 3`` with a
rank that SIGKILLs itself in the middle of an epoch. The job finishes on the two ranks left,
each epoch's samples are committed exactly once, every rank ends with the same parameters, the
reset callbacks ran, and the time from the kill to training again is printed."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from support import ROOT, mpi_env

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi
WORKER = ROOT / "tests" / "torch" / "elastic_worker.py"
#: the kill at the first batch of a one-epoch training
FAST_KILL = ("--epochs", "1", "--kill-epoch", "0", "--kill-batch", "0")


def elastic_run(tmp_path: Path, *launcher_args: str, worker_args=(), timeout=300):
    cmd = [sys.executable, "-m", "hpc_horovod.cli", "run", *launcher_args, sys.executable,
           str(WORKER), str(tmp_path), *worker_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=mpi_env({"HOROVOD_ELASTIC_DIR": str(tmp_path / "elastic")}),
                          cwd=ROOT)


def committed(log_dir: Path) -> Counter:
    lines = [line for path in log_dir.glob("committed-*")
             for line in path.read_text().splitlines()]
    return Counter(tuple(map(int, line.split())) for line in lines)


def test_a_killed_rank_is_survived_from_the_last_commit(tmp_path: Path):
    proc = elastic_run(tmp_path, "--min-np", "2", "--max-np", "3", "-np", "3")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "lost rank(s) 2 on host(s)" in out and "restarting 2 process(es) from the last " \
        "commit (reset 1)" in out, out
    again = re.search(r"training again ([\d.]+) s after the kill, at 2 ranks", out)
    assert again, out
    print(f"\nkill to training again: {again.group(1)} s")
    # the reset callbacks ran on both ranks left, on the committed state (epoch 1, one batch
    # of 3 ranks x 4 samples)
    for rank in (0, 1):
        assert f"reset callback: rank {rank} of 2, epoch 1, processed 12" in out, out
    counts = committed(tmp_path)
    assert set(counts.values()) == {1}, "a committed sample was processed twice"
    assert sorted(counts) == [(e, i) for e in range(3) for i in range(48)]
    finals = {p.name: p.read_text() for p in tmp_path.glob("final-*")}
    assert sorted(finals) == ["final-0", "final-1"] and len(set(finals.values())) == 1


def test_fewer_ranks_than_min_np_stop_with_what_was_lost(tmp_path: Path):
    # two ranks: rank 0 is left without any peer, and must still learn of the loss
    proc = elastic_run(tmp_path, "--min-np", "2", "--max-np", "2", "-np", "2",
                       worker_args=(*FAST_KILL, "--kill-size", "2", "--kill-rank", "1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert re.search(r"lost rank\(s\) 1 on host\(s\) \S+; only 1 process\(es\) could run, "
                     r"fewer than --min-np 2: stopping \(1 rank\(s\) lost in all, host\(s\) "
                     r"\S+\)", out), out
    assert "job failed" not in out, "a loss the launcher handles is not the job's failure"


def test_a_stopped_training_resumes_from_its_commit_in_a_new_job(tmp_path: Path):
    """A requeued SLURM job finds its commit the same way: the directory is the job's."""
    proc = elastic_run(tmp_path, "--min-np", "2", "--max-np", "3", "--reset-limit", "0",
                       "-np", "3")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "the reset limit (0) is reached: stopping" in out, out
    assert f"The last commit stays in {tmp_path / 'elastic'}" in out, out
    proc = elastic_run(tmp_path, "--min-np", "2", "-np", "2")  # no kill at this size
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "reset callback: rank 1 of 2, epoch 1, processed 12" in out, out
    counts = committed(tmp_path)
    assert set(counts.values()) == {1} and sorted(counts) == [(e, i) for e in range(3)
                                                               for i in range(48)]


def test_a_script_without_the_elastic_wrapper_is_named(tmp_path: Path):
    script = tmp_path / "plain.py"
    script.write_text("import hpc_horovod.torch as hvd\nhvd.init()\n")
    proc = subprocess.run([sys.executable, "-m", "hpc_horovod.cli", "run", "--min-np", "1",
                           "-np", "2", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120, env=mpi_env(), cwd=ROOT)
    assert proc.returncode != 0, proc.stderr
    assert "no rank reached hvd.elastic.run" in proc.stderr, proc.stderr


def test_an_error_of_the_script_is_not_restarted(tmp_path: Path):
    script = tmp_path / "bad.py"
    script.write_text("import torch\nimport hpc_horovod.torch as hvd\nhvd.init()\n"
                      "@hvd.elastic.run\ndef train(state):\n"
                      "    if hvd.rank() == 1:\n        raise ValueError('bad data')\n"
                      "    hvd.allreduce(torch.zeros(1))\n"
                      "train(hvd.elastic.ObjectState(epoch=0))\n")
    proc = subprocess.run([sys.executable, "-m", "hpc_horovod.cli", "run", "--min-np", "1",
                           "-np", "2", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120, env=mpi_env(), cwd=ROOT)
    assert proc.returncode != 0, proc.stderr
    assert re.search(r"rank\(s\) [\d, ]*1 failed on an error of the script \(.*bad data.*\); "
                     r"no restart", proc.stderr), proc.stderr
