"""A rank frozen between collectives ends a plain ``srun`` step (no ``--kill-on-bad-exit``,
SLURM's default) long before the job's time limit, on the test cluster's two real hosts
(conftest.py): the others' negotiation times out, its error names the frozen rank (a census
over the side channel, common/watch.py), and the survivors, exiting on it, cancel their step,
which srun would otherwise hold for the stopped task until the time limit. Rank 3 (on h2,
rank 0 the census's hub) leaves the error uncaught; rank 0 (the hub itself: the others say it
did not answer) has its error caught by the script, which exits."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

WORKER = Path(__file__).resolve().parent / "workers" / "frozen_rank.py"
#: small, yet long enough that a loaded machine's slow ranks are not taken for frozen ones
ENV = {"HOROVOD_PEER_TIMEOUT_SECONDS": "10"}
#: seconds from the freeze to the end of srun, at most: the peer timeout (10 s), the census
#: (2 s, 4 s when rank 0 is frozen), the wait for the frozen rank's acknowledgement of the
#: failure (5 s), SLURM's cancellation and a loaded machine's delays; the job's time limit is
#: 5 minutes
BOUND_S = 90.0
#: what the survivors' error says about the frozen rank
NAMED = {3: "rank 3 did not answer within 2 s (stopped, or blocked outside Python)",
         0: "rank 0 did not answer within 4 s (it is the hub of the census"}


@pytest.mark.parametrize("frozen, how", [(3, "raise"), (0, "catch")])
def test_a_rank_frozen_between_collectives_ends_the_srun_step(slurm, tmp_path, frozen, how):
    mark, log = tmp_path / "frozen_at", tmp_path / "srun.out"
    name = f"frozen-{os.getpid()}-{tmp_path.name}"
    cmd = ["srun", "-N", "2", "--ntasks-per-node=2", "--mpi=pmix", "--label", "-t", "5",
           "-J", name, sys.executable, str(WORKER), str(frozen), how, str(mark)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=slurm.env(ENV), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"rank {frozen} did not freeze in 120 s:\n{log.read_text()}")
            time.sleep(0.05)
        assert mark.exists(), log.read_text()
        frozen_at = float(mark.read_text())
        try:
            proc.wait(timeout=max(0.0, frozen_at + BOUND_S - time.time()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"srun still ran {BOUND_S:.0f} s after rank {frozen} froze (cancelled "
                        f"then):\n{log.read_text()}")
        took = time.time() - frozen_at
    finally:
        if proc.poll() is None:
            slurm.run(["scancel", "-n", name])
            proc.wait(timeout=60)
    out = log.read_text()
    assert proc.returncode != 0, out
    assert "not stopped" not in out, out
    assert NAMED[frozen] in out, out
    assert "(scancel): a frozen or orphaned task would hold it" in out, out
    print(f"rank {frozen} frozen ({how}): srun ended {took:.1f} s later")
