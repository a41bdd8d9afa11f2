"""Shared fixtures (the helpers behind them live in support.py, importable by tests)."""

import pytest
from support import run_mpi


@pytest.fixture
def mpirun():
    return run_mpi


@pytest.fixture
def leaves_engine_asleep(monkeypatch):
    """In a size-1 job whose engine thread sleeps (its timer cycle every 30 s), a check that
    ``call()`` completes without waking the thread, while ``control()`` (an asynchronous op)
    wakes it: ``leaves_engine_asleep(call, control)``."""
    import os
    import threading
    import time

    from hpc_horovod.common import basics

    for key in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_",
                                                       "HOROVOD_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "30000")
    basics.shutdown()
    basics.init()
    engine = basics.engine()
    deadline = time.monotonic() + 10
    while not engine.asleep:
        assert time.monotonic() < deadline, "the engine thread never fell asleep"
        time.sleep(0.001)
    wakes = []
    engine.on_wake = lambda: wakes.append(threading.get_ident())

    def check(call, control) -> None:
        call()
        assert wakes == [], "a synchronous op woke the engine thread"
        control()
        assert len(wakes) == 1, "the control did not wake the engine thread"

    yield check
    basics.shutdown()
