"""The ``hpc_horovod`` logger as ``init`` sets it up from ``HOROVOD_LOG_LEVEL`` and
``HOROVOD_LOG_HIDE_TIME`` (common/log.py): Horovod's levels, lines tagged with rank and host on
stderr, and nothing changed outside that logger."""

from __future__ import annotations

import logging
import re
import socket

import numpy as np
import pytest
from support import leave_launchers

import hpc_horovod as hvd
from hpc_horovod.common import log as log_mod
from hpc_horovod.common.config import Settings
from hpc_horovod.common.execution import Plan
from hpc_horovod.common.request import signature_of

HOST = socket.gethostname().split(".")[0]
TAG = f"[hpc_horovod 0@{HOST}]"


@pytest.fixture
def job(monkeypatch):
    """``init(level, hide_time=True)``: a job of size 1 with that log level; shut down after."""
    leave_launchers(monkeypatch)

    def start(level: str, hide_time: bool = True) -> None:
        monkeypatch.setenv("HOROVOD_LOG_LEVEL", level)
        monkeypatch.setenv("HOROVOD_LOG_HIDE_TIME", "1" if hide_time else "0")
        hvd.shutdown()
        hvd.init()

    yield start
    hvd.shutdown()


def test_debug_shows_the_backend_names_and_plans(job, capsys):
    job("debug")
    hvd.allreduce(np.ones(4, np.float32), name="w", op=hvd.Sum)
    hvd.allreduce(np.ones(4, np.float32), name="w", op=hvd.Sum)
    err = capsys.readouterr().err
    assert f"{TAG} DEBUG: backend: single: a process alone (single), MPI not loaded\n" in err
    assert err.count(f"{TAG} DEBUG: process set 0: agreed 'w': allreduce float32 [4]\n") == 1
    assert (f"{TAG} DEBUG: process set 0: plan of 1 tensor(s) (with names just agreed): "
            "allreduce fused (16 B): w\n") in err, err
    assert (f"{TAG} DEBUG: process set 0: plan of 1 tensor(s) (cached names): "
            "allreduce fused (16 B): w\n") in err, err


@pytest.mark.parametrize("level, shown", [
    ("trace", ["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"]),
    ("DEBUG", ["DEBUG", "INFO", "WARNING", "ERROR", "FATAL"]),
    ("info", ["INFO", "WARNING", "ERROR", "FATAL"]),
    ("warning", ["WARNING", "ERROR", "FATAL"]),
    ("error", ["ERROR", "FATAL"]),
    ("fatal", ["FATAL"]),
])
def test_horovods_levels(job, capsys, level, shown):
    job(level)
    capsys.readouterr()
    log = logging.getLogger("hpc_horovod")
    for value in (log_mod.TRACE, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR,
                  logging.CRITICAL):
        log.log(value, "level %d", value)
    err = capsys.readouterr().err
    assert re.findall(rf"^\[hpc_horovod 0@{re.escape(HOST)}\] (\w+): level \d+$", err,
                      re.M) == shown


def test_warning_shows_no_debug_and_a_timestamp_unless_hidden(job, capsys):
    job("warning", hide_time=False)
    hvd.allreduce(np.ones(4, np.float32), name="w")
    logging.getLogger("hpc_horovod").warning("look")
    err = capsys.readouterr().err
    assert re.fullmatch(rf"\[\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{{6}}: hpc_horovod 0@"
                        rf"{re.escape(HOST)}\] WARNING: look\n", err), err


def test_only_the_packages_logger_is_configured(job):
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    job("debug")
    job("trace")  # a second init replaces the handler of the first
    log = logging.getLogger("hpc_horovod")
    ours = [h for h in log.handlers if isinstance(h, log_mod._Stderr)]  # pytest adds its own
    assert len(ours) == 1 and log.propagate is False
    assert log.level == log_mod.TRACE
    assert root.handlers == handlers and root.level == level
    assert logging.getLevelName(log_mod.TRACE) == f"Level {log_mod.TRACE}"  # no global name


def test_plan_describe_gives_each_steps_kind_bytes_and_names():
    sigs = [signature_of("allreduce", np.ones(n, np.float32), hvd.Sum) for n in (4, 2)]
    sigs.append(signature_of("broadcast", np.ones(3), root=0))
    plan = Plan(["a", "b", "w"], sigs, 1 << 20)
    assert plan.describe() == "allreduce fused (24 B): a, b; broadcast (24 B): w"


@pytest.mark.parametrize("value", ["verbose", "warn", "0"])
def test_an_unknown_level_is_an_error_naming_the_allowed_ones(value):
    with pytest.raises(ValueError) as info:
        Settings.from_env({"HOROVOD_LOG_LEVEL": value})
    assert str(info.value) == (f"HOROVOD_LOG_LEVEL={value!r} is not a log level: use one of "
                               "trace, debug, info, warning, error, fatal (in any case)")
