"""Rank 0 holds one connection per other rank (common/watch.py): under a soft limit of open
files too low for them (``ulimit -n``: 1,024 on many clusters, against a job of 1,024 ranks),
``init`` raises that limit, saying so, and the job runs and names a killed rank as usual; with
a hard limit too low as well, ``init`` fails on every rank with an error that names
``ulimit -n`` and the numbers. Rank 0 lowers its limit to the files it has open once Open MPI
started, plus 3 (fd_limit_worker.py): the others need one connection each."""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.mpi
WORKER = os.path.join(os.path.dirname(__file__), "fd_limit_worker.py")
NP = 6


def test_rank_0_raises_a_soft_limit_too_low_for_its_connections(mpirun):
    proc = mpirun(NP, WORKER, 5, "soft", timeout=300, check=False)
    out = proc.stdout + proc.stderr
    low = int(re.search(r"rank 0: ulimit -n lowered to (\d+)", out).group(1))
    started = [r for r in range(NP) if f"rank {r}: started" in out]
    assert started == list(range(NP)), out
    assert re.search(r"hpc_horovod 0@\S+\] WARNING: raised its soft limit of open files "
                     rf"\(ulimit -n\) from {low} to ", out), out
    assert f"for its {NP - 1} connections to the other ranks" in out, out
    assert f"rank 0: started, ulimit -n {low}\n" not in out, out
    assert proc.returncode != 0, out
    assert "survived" not in out, out
    assert "Lost rank(s) 5 on host " in out, out


def test_a_hard_limit_too_low_fails_init_on_every_rank_naming_ulimit(mpirun):
    proc = mpirun(NP, WORKER, 5, "both", timeout=300, check=False)
    out = proc.stdout + proc.stderr
    low = int(re.search(r"rank 0: ulimit -n lowered to (\d+)", out).group(1))
    assert proc.returncode != 0, out
    assert "started" not in out, out
    for rank in range(NP):
        assert (f"[1,{rank}]<stderr>:RuntimeError: the ranks could not open their connections "
                "to rank 0") in out, out
    assert f"but the hard limit is {low}: raise `ulimit -n` (soft {low}, hard {low})" in out, out
