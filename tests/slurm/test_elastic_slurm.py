"""Elastic training in a SLURM job across the test cluster's two real hosts (conftest.py): the
script of ``hpc-horovod sbatch -N 2 --ntasks-per-node 2 --min-nodes 1`` (``--no-kill``, the
elastic launcher in the batch script) survives the loss of every rank of host h2: a new step
runs on h1 alone from the last commit, each epoch's samples are committed exactly once, and the
job completes with no step left behind."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from hpc_horovod.slurm.render import render_job

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "torch" / "elastic_worker.py"


def test_a_lost_host_is_left_out_and_the_training_goes_on(slurm, tmp_path):
    pytest.importorskip("torch")
    logs = tmp_path / "logs"
    logs.mkdir()
    script = tmp_path / "elastic.sbatch"
    script.write_text(render_job(
        [sys.executable, str(WORKER), str(logs), "--kill-size", "4", "--kill-host", "h2"],
        nodes=2, ntasks_per_node=2, min_nodes=1, time="10", modules=[], output="job-%j.out",
        job_name="elastic"))
    text = script.read_text()
    assert "#SBATCH --no-kill" in text and "run --min-np 2 --max-np 4 -np 4" in text, text
    status, record = slurm.submit_and_wait(script, timeout=300)
    job_id = record["JobId"]
    out = (tmp_path / f"job-{job_id}.out").read_text()
    assert status == 0 and record["JobState"] == "COMPLETED", out + slurm.logs()
    assert re.search(r"lost rank\(s\) 2, 3 on host\(s\) h2; restarting 2 process\(es\) from "
                     r"the last commit \(reset 1\)", out), out
    again = re.search(r"training again ([\d.]+) s after the kill, at 2 ranks", out)
    assert again, out
    print(f"\nhost h2 lost: training again on h1 {again.group(1)} s after the kill")
    lines = [line for path in logs.glob("committed-*") for line in path.read_text().splitlines()]
    counts = Counter(tuple(map(int, line.split())) for line in lines)
    assert set(counts.values()) == {1} and sorted(counts) == [(e, i) for e in range(3)
                                                               for i in range(48)]
    assert {p.name.split("-")[1] for p in logs.glob("committed-*")} == {"h1", "h2"}
    finals = {p.name: p.read_text() for p in logs.glob("final-*")}
    assert sorted(finals) == ["final-0", "final-1"] and len(set(finals.values())) == 1
    # the commit directory of a job that ended well is gone; no step is left in squeue
    assert not (tmp_path / ".hpc_horovod" / "elastic" / job_id).exists()
    steps = slurm.run(["squeue", "--steps", "-h", "-j", job_id]).stdout.strip()
    assert steps == "", steps
