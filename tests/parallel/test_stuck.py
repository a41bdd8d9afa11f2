"""No collective waits for ever on a frozen peer (stuck_worker.py, under ``hpc-horovod run``):
one rank (the last, or rank 0) stops itself with SIGSTOP, its process and side channel alive.
Inside a blocking data call the others' watch notices the call past its deadline, a census
over the side channel names the frozen rank, and the job ends non-zero, rank 0's summary
naming the rank and the op (when rank 0, the census's hub, is the frozen one, the others say
that it did not answer); between ops the others' negotiation times out with an error, raised
to the caller, that names the frozen rank. Every process is gone after the launcher's exit
(mpirun kills a stopped one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from support import ROOT, mpi_env
from test_job_end import untagged

pytestmark = pytest.mark.mpi
WORKER = os.path.join(os.path.dirname(__file__), "stuck_worker.py")
ENV = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_PEER_TIMEOUT_SECONDS": "3"}
#: seconds from the freeze to the launcher's exit, at most: the deadline (3 s), the census
#: (2 s), the grace before exiting (3 s) and a loaded machine's delays
BOUND_S = 40.0


def run_job(np_: int, scenario: str, tmp_path, frozen: int) -> tuple[str, float]:
    cmd = [sys.executable, "-m", "hpc_horovod.cli", "run", "-np", str(np_), sys.executable,
           WORKER, scenario, str(frozen)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=ROOT,
                          env=mpi_env({**ENV, "STUCK_DIR": str(tmp_path)}))
    ended = time.time()
    out = untagged(proc.stdout + proc.stderr)
    assert proc.returncode != 0, out
    assert "not stopped" not in out, out
    took = ended - float((tmp_path / "frozen_at").read_text())
    assert took < BOUND_S, f"{took:.1f} s\n{out}"
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(np_)]
    give_up = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < give_up:
        time.sleep(0.2)
    left = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    assert not left, f"processes {left} outlived the job\n{out}"
    return out, took


def summary(np_: int, op: str) -> str:
    """The start of rank 0's one line when the last of ``np_`` ranks froze inside ``op``."""
    frozen = np_ - 1
    others = "rank 0" if np_ == 2 else "ranks " + ", ".join(map(str, range(frozen)))
    return (f"job failed: a collective did not complete: rank {frozen} did not answer within "
            f"2 s (stopped, or blocked outside Python); {others} in {op} 'frozen.op' (")


@pytest.mark.parametrize("np_, op", [(3, "broadcast"), (4, "allgather")])
def test_a_rank_frozen_inside_a_data_call_ends_the_job_naming_it(np_, op, tmp_path):
    out, took = run_job(np_, op, tmp_path, frozen=np_ - 1)
    assert summary(np_, op) in out, out
    print(f"{np_} ranks, {op}: the job ended {took:.1f} s after rank {np_ - 1} froze")


def test_rank_0_frozen_inside_a_data_call_is_named_as_the_hub(tmp_path):
    """Rank 0 runs the census: rank 1 hears nothing from it, says so, and exits."""
    out, took = run_job(2, "allreduce", tmp_path, frozen=0)
    assert re.search(r"hpc_horovod 1@\S+\] ERROR: exiting, a collective", out), out
    assert ("] ERROR: exiting, a collective did not complete: rank 0 did not answer within "
            "4 s (it is the hub of the census: stopped, or blocked outside Python); this "
            "rank (1) in allreduce 'frozen.op' (4.0 KiB, process set 0) for ") in out, out
    print(f"2 ranks, allreduce: the job ended {took:.1f} s after rank 0 froze")


def test_a_rank_frozen_between_ops_is_named_by_the_negotiation_timeout(tmp_path):
    out, took = run_job(2, "negotiation", tmp_path, frozen=1)
    # the cheap phase, or the full one's exchange of sizes or names: wherever rank 1 froze
    assert re.search(r"rank 0: caught: no answer from some of the 2 ranks for 3 s \((negotiation"
                     r"|allgather|exchange of pending names)\): rank 1 did not answer within 2 s "
                     r"\(stopped, or blocked outside Python\); rank 0 in the negotiation of "
                     r"process set 0 for ", out), out
    print(f"negotiation: the job ended {took:.1f} s after rank 1 froze")
