"""Shared fixtures (the helpers behind them live in support.py, importable by tests)."""

import pytest
from support import run_mpi


@pytest.fixture
def mpirun():
    return run_mpi
