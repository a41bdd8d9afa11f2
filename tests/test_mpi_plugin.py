"""The parallel checks' harness (mpi_plugin.py, support.mpi_checks): a check that fails on one
rank while the others wait for it in a collective ends on every rank at once, and the next
check runs on a new engine, in step."""

import time

from support import CHECK_TIMEOUT_S, _run_checks

CHECKS = '''
import hpc_horovod as hvd
import numpy as np


def test_fails_on_rank_0():
    hvd.init()
    if hvd.rank() == 0:
        assert False, "rank 0 fails by itself"
    hvd.barrier()  # the others wait for rank 0 here


def test_next():
    hvd.init()
    assert hvd.allreduce(np.ones(3), op=hvd.Sum).tolist() == [hvd.size()] * 3
'''


def test_a_failure_on_one_rank_ends_the_check_everywhere(tmp_path):
    module = tmp_path / "mpi_failing.py"
    module.write_text(CHECKS)
    start = time.monotonic()
    run = _run_checks(module, 2, None, [], 300, tmp_path)
    elapsed = time.monotonic() - start
    failed = run["checks"]["test_fails_on_rank_0"]
    assert failed[0][0] == "failed" and "rank 0 fails by itself" in failed[0][1], failed
    assert failed[1][0] == "failed" and "shut down" in failed[1][1].lower(), failed
    assert run["checks"]["test_next"] == {0: ("passed", ""), 1: ("passed", "")}, run["out"]
    assert elapsed < CHECK_TIMEOUT_S / 2, f"rank 1 waited out its timeout ({elapsed:.0f} s)"
