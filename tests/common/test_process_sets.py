"""Process sets in one process, without MPI: static and dynamic sets of a job of size 1 and the
checks of their arguments."""

from __future__ import annotations

import numpy as np
import pytest
from support import leave_launchers

import hpc_horovod as hvd


# -- process sets ---------------------------------------------------------------------------------
def test_static_process_set(monkeypatch):
    hvd.shutdown()
    leave_launchers(monkeypatch)
    ps = hvd.ProcessSet([0])
    hvd.init(process_sets=[ps])
    try:
        assert ps.process_set_id == 1 and ps.size() == 1 and ps.rank() == 0 and ps.included()
        np.testing.assert_array_equal(hvd.allreduce(np.ones(2), process_set=ps), np.ones(2))
        assert hvd.broadcast(np.ones(2), 0, process_set=ps).tolist() == [1.0, 1.0]
        with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1"):
            hvd.add_process_set([0])
    finally:
        hvd.shutdown()
    assert ps.process_set_id is None
    with pytest.raises(ValueError, match="was not registered"):
        ps.size()


def test_process_set_validation(monkeypatch):
    with pytest.raises(ValueError, match="distinct ranks"):
        hvd.ProcessSet([0, 0])
    with pytest.raises(ValueError, match="distinct ranks"):
        hvd.ProcessSet([])
    hvd.shutdown()
    leave_launchers(monkeypatch)
    with pytest.raises(ValueError, match=r"ranks \[3\] are outside the job of size 1"):
        hvd.init(process_sets=[hvd.ProcessSet([0, 3])])
    hvd.shutdown()


def test_dynamic_process_sets(monkeypatch):
    hvd.shutdown()
    leave_launchers(monkeypatch)
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    hvd.init()
    try:
        ps = hvd.add_process_set([0])
        assert ps.process_set_id is not None and ps.size() == 1
        assert hvd.allgather(np.ones(1), process_set=ps).tolist() == [1.0]
        with pytest.raises(ValueError, match="already exists"):
            hvd.add_process_set([0])
        assert hvd.remove_process_set(ps) is True
        assert ps.process_set_id is None
        assert hvd.remove_process_set(ps) is False
        assert hvd.remove_process_set(hvd.global_process_set) is False
        with pytest.raises(ValueError, match="not registered"):
            hvd.allreduce(np.ones(1), process_set=ps)
    finally:
        hvd.shutdown()
