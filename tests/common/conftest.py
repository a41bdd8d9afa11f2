"""Fixtures of the tests of ``hpc_horovod.common``."""

import pytest
from support import single_process_job

import hpc_horovod as hvd


@pytest.fixture
def single(monkeypatch):
    """``hpc_horovod`` initialized as a job of size 1 (no MPI), shut down afterwards."""
    with single_process_job(hvd, monkeypatch) as job:
        yield job
