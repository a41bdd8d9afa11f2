"""Threads against the CPUs SLURM allocated (issue 34 item 11): a plain ``srun -n 2`` of a CPU
job runs a thread pool as large as what each task may run on, on every rank; ``doctor`` says so
for every rank and ``hvd.init()`` once, on rank 0, when it is certain. The test cluster's
TaskPlugin is task/none, so that srun binds nothing, as on many clusters."""

from __future__ import annotations

import re
import sys

import pytest

from hpc_horovod.common.topology import Topology
from hpc_horovod.slurm import preflight

pytestmark = pytest.mark.slurm

PYTHON = [sys.executable]
INIT = ("import sys, torch, hpc_horovod as hvd; torch.set_num_threads(int(sys.argv[1])); "
        "hvd.init(); print('rank', hvd.rank(), 'threads', torch.get_num_threads()); "
        "hvd.shutdown()")


def _srun(slurm, *args, timeout=120):
    return slurm.run(["srun", "-N", "1", "-n", "2", *args], timeout=timeout)


def test_doctor_shows_threads_per_rank_against_allocated_cpus(slurm):
    # -c 1: one CPU per task; OMP_NUM_THREADS=3 asks three threads of each rank
    over = _srun(slurm, "-c", "1", "env", "OMP_NUM_THREADS=3", *PYTHON, "-m", "hpc_horovod",
                 "doctor")
    assert over.returncode == 0, over.stdout + over.stderr
    rows = [line.split() for line in over.stdout.splitlines()[2:4]]
    assert [r[5] for r in rows] == ["3/1", "3/1"], over.stdout
    assert re.search(r"warning \(rank 0-1\): 3 threads per rank \(OMP_NUM_THREADS=3\) for 1 "
                     r"CPU\(s\) SLURM allocated to the task \(\d+ it may run on\): the 2 "
                     r"rank\(s\) of this node oversubscribe their CPUs; one thread per allocated"
                     r" CPU, as the generated job scripts do: export OMP_NUM_THREADS=1 before "
                     r"srun", over.stdout), over.stdout

    unset = _srun(slurm, "-c", "1", "env", "-u", "OMP_NUM_THREADS", *PYTHON, "-m",
                  "hpc_horovod", "doctor")
    assert unset.returncode == 0, unset.stdout + unset.stderr
    assert "OMP_NUM_THREADS unset: each of the 2 rank(s) on this node starts a thread per CPU " \
           "it may run on" in unset.stdout, unset.stdout

    one = _srun(slurm, "-c", "1", *PYTHON, "-m", "hpc_horovod", "doctor")  # OMP_NUM_THREADS=1
    assert one.returncode == 0, one.stdout + one.stderr
    assert "1 thread(s) per rank (OMP_NUM_THREADS=1) for 1 allocated CPU(s)" in one.stdout
    assert "warning" not in one.stdout, one.stdout


def test_init_warns_once_when_torch_has_more_threads_than_cpus(slurm):
    proc = _srun(slurm, "-c", "1", *PYTHON, "-c", INIT, "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "[hpc_horovod] warning" in line]
    assert len(warnings) == 1, proc.stderr  # rank 0 only
    assert re.search(r"2 ranks on this node x 2 threads \(torch.get_num_threads\(\)\) = 4 threads"
                     r" for the 2 CPU\(s\) SLURM allocated on it|2 threads per rank \(torch.get_"
                     r"num_threads\(\)\) for the 1 CPU\(s\) it may run on", warnings[0]), warnings
    assert "export OMP_NUM_THREADS=1 (or torch.set_num_threads(1))" in warnings[0], warnings
    assert warnings[0].endswith("srun hpc-horovod doctor shows every rank's threads against its "
                                "CPUs"), warnings  # a whole sentence

    fits = _srun(slurm, "-c", "1", *PYTHON, "-c", INIT, "1")
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert "[hpc_horovod] warning" not in fits.stderr, fits.stderr


def test_threads_within_the_allocation_are_fine(monkeypatch):
    """Without SLURM nothing is said; in a step, OMP_NUM_THREADS against the task's share
    (torch, which other tests of this process imported, would be asked first: it is hidden)."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    topo = Topology(rank=0, size=2, local_rank=0, local_size=2, cross_rank=0, cross_size=1,
                    hostname="h1", launcher="slurm")
    assert preflight.check_threads({"OMP_NUM_THREADS": "8"}, topo, affinity=8) == []
    env = {"SLURM_CPUS_ON_NODE": "8", "OMP_NUM_THREADS": "4"}
    (finding,) = preflight.check_threads(env, topo, affinity=8)
    assert finding.level == preflight.OK and "4 thread(s) per rank" in finding.message
    (finding,) = preflight.check_threads({**env, "OMP_NUM_THREADS": "8"}, topo, affinity=8)
    assert finding.level == preflight.WARNING and "OMP_NUM_THREADS=4 before srun" in \
        finding.message
