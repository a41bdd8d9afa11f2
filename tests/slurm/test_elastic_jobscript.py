"""The job script of ``hpc-horovod sbatch --min-nodes K``: a ``--no-kill`` job whose body is the
elastic launcher over the job's ranks (restarted on the nodes left while K remain); its bounds
checked; refused by ``submit()``, which returns one result per rank of the job it asked for."""

from __future__ import annotations

import sys

import pytest

from hpc_horovod.slurm import submit
from hpc_horovod.slurm.render import render_job


def test_min_nodes_makes_a_no_kill_job_running_the_elastic_launcher():
    text = render_job(["python3", "train.py"], nodes=4, ntasks_per_node=2, min_nodes=2,
                      modules=[], time="60")
    assert "#SBATCH --no-kill" in text
    launch = [line for line in text.splitlines() if "hpc_horovod.cli run" in line]
    assert launch == [f"{sys.executable} -m hpc_horovod.cli run --min-np 4 --max-np 8 -np 8 "
                      "--srun-mpi pmix python3 train.py"], text
    assert "srun --mpi" not in text
    plain = render_job(["python3", "train.py"], nodes=4, ntasks_per_node=2, modules=[],
                       time="60")
    assert "--no-kill" not in plain and "hpc_horovod.cli run" not in plain


@pytest.mark.parametrize("min_nodes", [0, 3])
def test_min_nodes_must_lie_within_the_jobs_nodes(min_nodes):
    with pytest.raises(ValueError, match=f"--min-nodes {min_nodes}: between 1 and --nodes 2"):
        render_job(["python3", "t.py"], nodes=2, min_nodes=min_nodes, modules=[], time="60")


def test_a_submitted_function_is_not_elastic(tmp_path):
    with pytest.raises(ValueError, match="min_nodes: elastic training .* hpc-horovod sbatch "
                                         "--min-nodes"):
        submit(print, nodes=2, min_nodes=1, workdir=tmp_path)
