"""Jobs of 4 hosts x 4 ranks on a test cluster of its own (h1 to h4: network namespaces with
their own hostname and address, conftest.py and hosts.py), under ``srun --mpi=pmix``: more
ranks than this machine has cores, so the ranks take turns on them, as on a loaded node.

What the size shows that 2 hosts x 2 ranks does not: slices of the node's window allreduced
across four nodes at once beside MPI's own allreduce over all sixteen ranks; the hammer
(workers/hammer.py: every path of the hierarchical backend, submissions in a different order on
every rank, random pauses between and inside steps) with several seeds; a DistributedOptimizer
run with process sets and uneven ends (torch/long_run.py); the layout SLURM gives; and a lost
host named among sixteen ranks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import start_cluster

pytestmark = pytest.mark.slurm

WORKERS = Path(__file__).resolve().parent / "workers"
LONG_RUN = Path(__file__).resolve().parents[1] / "torch" / "long_run.py"
HOSTS = ("h1", "h2", "h3", "h4")
SRUN_4X4 = ["srun", "-N", "4", "--ntasks-per-node=4", "--mpi=pmix", "--label"]
#: seeds of the hammer's pauses: each is one job (more of them: tests/slurm/workers/hammer.py)
SEEDS = (1,)


@pytest.fixture(scope="module")
def cluster(slurm):
    """A cluster of four hosts, beside the session's two (``slurm``: skipped with its reason
    where SLURM or namespaces are missing), for this module only."""
    four = start_cluster(HOSTS)
    try:
        yield four
    finally:
        four.stop()
        shutil.rmtree(four.root, ignore_errors=True)


def test_layout_of_four_hosts(cluster):
    proc = cluster.run([*SRUN_4X4, sys.executable, str(WORKERS / "check_layout.py"),
                        "4,4,4,4"], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("seed", SEEDS)
def test_hammer(cluster, seed):
    proc = cluster.run([*SRUN_4X4, sys.executable, str(WORKERS / "hammer.py"), "30",
                        str(seed)], timeout=400, env={"HOROVOD_PEER_TIMEOUT_SECONDS": "120"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "hammer ok: 30 steps" in out, out


def test_distributed_optimizer_with_process_sets_and_uneven_ends(cluster):
    steps = 12
    proc = cluster.run([*SRUN_4X4, sys.executable, str(LONG_RUN), str(steps)], timeout=500,
                       env={"HOROVOD_BUCKET_BYTES": "2048",
                            "HOROVOD_PEER_TIMEOUT_SECONDS": "120"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for rank in range(16):
        assert f"rank {rank}: long run ok ({steps + 3 * rank} steps)" in out, out


def test_a_lost_host_is_named_among_sixteen_ranks(cluster, tmp_path):
    """The ranks of h3 (8 to 11) kill themselves at step 5 (lose_host.py): under plain srun
    the survivors stop within seconds, naming h3 and its ranks."""
    mark, log = tmp_path / "killed_at", tmp_path / "srun.out"
    name = f"lose-h3-{os.getpid()}"
    with open(log, "w") as out:
        proc = subprocess.Popen([*SRUN_4X4, "-J", name, sys.executable,
                                 str(WORKERS / "lose_host.py"), "h3", str(mark)],
                                stdout=out, stderr=subprocess.STDOUT, env=cluster.env(),
                                cwd=tmp_path)
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        cluster.run(["scancel", "-n", name])
        proc.wait(timeout=60)
        pytest.fail(f"the job still ran 300 s after it started:\n{log.read_text()}")
    text = log.read_text()
    marks = list(tmp_path.glob("killed_at.*"))
    assert sorted(int(m.suffix[1:]) for m in marks) == [8, 9, 10, 11], (marks, text)
    killed_at = min(float(m.read_text()) for m in marks)
    ended = time.time()
    assert proc.returncode != 0, text
    assert "survived" not in text, text
    survivors = "\n".join(line for line in text.splitlines()
                          if re.match(r"(\d+): ", line) and int(line.split(":")[0]) not in
                          (8, 9, 10, 11))
    assert "h3" in survivors and re.search(r"\b8\b\D{0,5}\b11\b|8, 9, 10, 11", survivors), text
    assert ended - killed_at < 60, f"the job ended {ended - killed_at:.0f} s after the kill"
