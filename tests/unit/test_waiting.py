"""Polling a non-blocking MPI request (backends/waiting.py), on real requests of this process."""

from __future__ import annotations

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from hpc_horovod.backends import waiting  # noqa: E402
from hpc_horovod.common.errors import HorovodInternalError  # noqa: E402


def test_a_request_that_never_completes_is_reported_and_kept_alive():
    """An Irecv nobody sends to: after the timeout the error names what was waited for, and the
    request (which holds its receive buffer) stays referenced, since a late peer would still
    complete it and MPI would write into that buffer."""
    buf = np.zeros(4, np.int64)
    req = MPI.COMM_SELF.Irecv(buf, source=0, tag=77)
    try:
        with pytest.raises(HorovodInternalError,
                           match=r"no answer from some of the 3 ranks for 0 s \(the table\)"):
            waiting.RequestWaiter(3).wait(req, 0.05, "the table")
        assert any(kept is req for kept in waiting._abandoned)
    finally:
        req.Cancel()
        req.Wait()
        waiting._abandoned.remove(req)


def test_a_completed_request_returns_at_once():
    buf = np.zeros(1, np.int64)
    recv = MPI.COMM_SELF.Irecv(buf, source=0, tag=78)
    MPI.COMM_SELF.Send(np.array([5], np.int64), dest=0, tag=78)
    waiting.RequestWaiter(1).wait(recv, 0.05, "a message")
    assert buf[0] == 5
