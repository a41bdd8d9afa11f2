"""What a job does when a rank fails: an exception, a stall, a SIGKILL. Every scenario must end
(no hang: the fixture's timeout is the bound) with a message that names the culprit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mpi_output import by_rank, launcher_text
from support import mpi_env

HERE = Path(__file__).parent
WORKER = HERE / "failures_worker.py"
pytestmark = pytest.mark.mpi
STALL_TEXT = ("One or more tensors were submitted to be reduced, gathered or broadcasted by "
              "subset of ranks and are waiting for remainder of ranks for more than 1 seconds.")


def test_exception_on_one_rank_fails_the_others_pending_op(mpirun):
    proc = mpirun(3, WORKER, "exception", timeout=60, check=False)
    assert proc.returncode != 0  # rank 2 died of its exception
    out = by_rank(proc)
    assert "RuntimeError: boom on purpose" in out[2]  # its own traceback
    for rank in (0, 1):
        assert f"rank {rank}: failed after" in out[rank], proc.stdout + proc.stderr
        assert "Rank 2 stopped first, with: RuntimeError: boom on purpose" in out[rank]
        assert f"rank {rank}: then refused with: Horovod has been shut down." in out[rank]
        assert f"rank {rank}: done" in out[rank]


def test_stall_warning_names_the_missing_rank_and_tensor(mpirun):
    proc = mpirun(2, WORKER, "stall", timeout=60,
                  env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    out = by_rank(proc)
    assert "] WARNING: " + STALL_TEXT in out[0], proc.stderr
    assert "Missing ranks:\n1: [late.tensor]" in out[0]
    assert "Missing ranks" not in out[1]  # rank 0 reports for everyone
    assert "rank 0: stall resolved" in out[0] and "rank 1: stall resolved" in out[1]


def test_each_stall_report_is_printed_once(mpirun):
    proc = mpirun(2, WORKER, "stall", timeout=60,
                  env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    out = by_rank(proc)[0]
    assert out.count("Missing ranks:") == out.count("] WARNING: ")


def test_stall_shutdown_stops_every_rank_with_the_message(mpirun):
    proc = mpirun(3, WORKER, "stall_shutdown", timeout=60,
                  env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
                       "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2"})
    out = by_rank(proc)
    for rank in range(3):
        text = out[rank]
        assert f"rank {rank}: stopped after" in text, proc.stdout + proc.stderr
        assert STALL_TEXT in text
        assert "2: [orphan]" in text and "0: [barrier.noname.0]" in text
        assert ("All ranks stop now: a stall lasted longer than "
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=2.") in text
        assert f"rank {rank}: done" in text


def test_a_stall_and_a_mismatch_in_a_process_set_name_global_ranks(mpirun):
    proc = mpirun(3, WORKER, "stall_in_set", timeout=60,
                  env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    out = by_rank(proc)
    assert "Missing ranks:\n2: [set.late]" in out[1], out[1]  # set rank 0 reports
    for rank in (1, 2):
        assert f"rank {rank}: failed with: Mismatched data types: One rank had type float32, " \
               "but another rank had type float64. [tensor 'set.bad': rank 1 vs rank 2]" \
               in out[rank], out[rank]


def test_a_rank_that_shuts_down_early_is_named_by_the_others(mpirun):
    proc = mpirun(3, WORKER, "early_exit", timeout=60)
    out = by_rank(proc)
    for rank in (1, 2):
        assert f"rank {rank}: failed with: Horovod has been shut down." in out[rank], proc.stdout
        assert "Rank(s) 0 called shutdown while this rank still runs." in out[rank]
    assert "rank 0: done" in out[0]


def test_a_rank_that_shuts_down_while_the_others_wait_leaves_at_once(mpirun):
    """The ranks it leaves behind close the node's shared window with it in the cycle that
    stops, rather than when their scripts end."""
    proc = mpirun(3, WORKER, "early_exit_pending", timeout=60)
    out = by_rank(proc)
    for rank in (1, 2):
        assert "Rank(s) 0 called shutdown while this rank still runs." in out[rank], out[rank]
        assert f"rank {rank}: done" in out[rank]
    took = float(out[0].split("rank 0: shut down in ")[1].split()[0])
    assert took < 2.0, out[0]


def test_a_backend_failure_on_one_rank_completes_its_handle(mpirun):
    proc = mpirun(2, WORKER, "local_failure", timeout=60, check=False,
                  env={"HOROVOD_PEER_TIMEOUT_SECONDS": "2"})
    out = by_rank(proc)
    assert "rank 1: failed with: broadcast failed: " in out[1], proc.stdout
    # rank 0 learns why at once (common.watch), long before its peer timeout
    assert "rank 0: failed with: " in out[0], proc.stdout
    assert "Rank 1 stopped first, with: broadcast failed: " in out[0]


def _assert_killed_rank_named(proc) -> None:
    assert proc.returncode != 0
    assert "rank 1: killing myself" in proc.stdout
    text = launcher_text(proc)
    # Open MPI's own report names the rank and the signal
    assert "mpirun noticed that process rank 1 with PID" in text, text
    assert "exited on signal 9 (Killed)" in text
    assert "1000 allreduces completed" not in proc.stdout + proc.stderr


def test_sigkill_of_a_rank_ends_the_job_under_mpirun(mpirun):
    proc = mpirun(2, WORKER, "kill", timeout=60, check=False)
    _assert_killed_rank_named(proc)


def test_sigkill_of_a_rank_ends_the_job_under_hpc_horovod_run(mpirun):
    launcher = Path(sys.executable).with_name("hpc-horovod")
    env = mpi_env()  # the clean MPI environment of the fixture's runs
    proc = subprocess.run([str(launcher), "run", "-np", "2", sys.executable, str(WORKER), "kill"],
                          capture_output=True, text=True, timeout=60, env=env)
    _assert_killed_rank_named(proc)
