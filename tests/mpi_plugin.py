"""Loaded (``-p mpi_plugin``) by every rank of ``mpirun -np N python -m pytest <module>`` as
support.mpi_checks starts it: each rank writes one JSON line per test phase to
``$HVD_CHECKS_REPORT`` (``{rank}`` replaced), which the outer run reads, and keeps the ranks in
step, one check at a time.

In step: a check that hangs on some ranks ends there by its timeout (SIGALRM, see
support.CHECK_TIMEOUT_S), which stops the engine on every rank (the next check's ``hvd.init()``
starts a new one); meanwhile a rank that had finished it may have gone on to the next check and
failed there. A check that fails on one rank by itself (an assertion, not a hang) stops the engine
on every rank at once (``hvd.shutdown()``): a peer waiting for it in a collective raises instead of
waiting out its timeout. Before each check the ranks tell each other which check they are at: a
rank behind fails its check at once (it is out of step) until it reaches the others. A watchdog
prints every thread's stack to ``$HVD_CHECKS_REPORT.stacks`` and ends the process when a check (or
the wait for the other ranks before it) goes on a minute past its timeout: a wait inside MPI
itself, which no signal handler interrupts (a collective that the other ranks never call, after a
check failed on some of them); the launcher then ends the job, and the outer run reports the checks
that finished and this one, with the stacks. Every rank's fixtures have run before any rank's
check starts: a check that begins with ``hvd.shutdown()`` would otherwise stop the engine of a
slower peer (a shutdown stops every rank) before that peer's fixture looked at it, and the peer
would start a new engine alone, in a collective nobody else calls. With ``HVD_TEST_ONE_CORE``
set, each rank binds itself to one core first (the engine's ``overlaps``: host work then runs on
the thread that waits)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys

import pytest

_report = None
_stacks = None
_comm = None


def _world():
    global _comm
    if _comm is None:
        from mpi4py import MPI

        _comm = MPI.COMM_WORLD.Dup()  # the same first check on every rank: collective
    return _comm


def pytest_configure(config) -> None:
    global _report, _stacks
    path = os.environ.get("HVD_CHECKS_REPORT")
    if path:
        from mpi4py import MPI

        path = path.format(rank=MPI.COMM_WORLD.Get_rank())
        _report = open(path, "w")  # noqa: SIM115
        _stacks = open(path + ".stacks", "w")  # noqa: SIM115
        faulthandler.enable(file=_stacks)  # a crash's stacks (pytest captures stderr)
        if os.environ.get("HVD_TEST_ONE_CORE"):  # a rank bound to one core (engine.overlaps)
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[MPI.COMM_WORLD.Get_rank() % len(cores)]})


def pytest_runtest_logreport(report) -> None:
    if _report is None:
        return
    xfail = getattr(report, "wasxfail", None)
    text = report.longreprtext if report.outcome != "passed" else ""
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        text = report.longrepr[2]
    _report.write(json.dumps({"id": report.nodeid.split("::", 1)[1], "when": report.when,
                              "outcome": report.outcome, "xfail": xfail,
                              "text": text[-8000:]}) + "\n")
    _report.flush()
    if report.when == "call" and report.failed:
        basics = sys.modules.get("hpc_horovod.common.basics")
        if basics is not None and basics.is_initialized():
            basics.shutdown()


@pytest.fixture(autouse=True)
def _in_step(request):
    timeout = float(request.config.getoption("timeout", None) or 0)
    watchdog = {"file": _stacks} if _stacks is not None else {}
    if timeout:
        faulthandler.dump_traceback_later(timeout + 60, exit=True, **watchdog)
    comm = _world()
    position = request.session.items.index(request.node)
    while True:
        positions = comm.allgather(position)
        if position < max(positions):
            pytest.fail(f"rank {comm.Get_rank()} is out of step (the ranks are at checks "
                        f"{positions}): an earlier check failed or hung on some rank")
        if min(positions) == position:
            break  # every rank is here; otherwise wait for those behind
    if timeout:
        faulthandler.dump_traceback_later(timeout + 60, exit=True, **watchdog)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """After this check's fixtures, failed or not, wait for every rank's (see the module's
    docstring)."""
    yield
    _world().Barrier()
