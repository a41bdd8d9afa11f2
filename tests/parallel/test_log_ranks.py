"""``HOROVOD_LOG_LEVEL`` and ``horovodrun --log-level`` on two ranks: ``debug`` shows the
backend chosen and why, each name the ranks agree on (once) and each plan with its sizes;
``warning``, the default, shows only what needs the user (here a stall), none of that. Every
line is tagged with its rank and host, after Horovod's timestamp unless it is hidden."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_output import assert_every_rank_says, by_rank
from support import clean_env

pytestmark = pytest.mark.mpi
WORKER = Path(__file__).with_name("log_worker.py")
HOST = re.escape(socket.gethostname().split(".")[0])
STAMP = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}: "
#: the worker's tensors: name -> bytes
TENSORS = {"grad.0": 16, "grad.1": 8, "weights": 24}
AGREED = ["process set 0: agreed 'grad.0': allreduce float32 [4]",
          "process set 0: agreed 'grad.1': allreduce float32 [2]",
          "process set 0: agreed 'weights': broadcast float64 [3]"]


def logged(text: str, rank: int, level: str, stamp: str = STAMP) -> list[str]:
    """The messages of ``level`` that ``rank`` logged, each line's tag checked."""
    return re.findall(rf"^{stamp}hpc_horovod {rank}@{HOST}\] {level}: (.*)$", text, re.M)


def planned(messages: list[str]) -> dict[str, int]:
    """Name -> bytes of its step, from the plans in ``messages``; checks that each step's
    bytes are those of its tensors (fused: their sum)."""
    names = {}
    for message in messages:
        steps = re.fullmatch(r"process set 0: plan of \d+ tensor\(s\) \([a-z ]+\): (.*)",
                             message)
        if steps is None:
            continue
        for step in steps.group(1).split("; "):
            kind, nbytes, members = re.fullmatch(r"(\w+(?: fused)?) \((\d+) B\): (.*)",
                                                 step).groups()
            members = members.split(", ")
            assert int(nbytes) == sum(TENSORS[name] for name in members), message
            assert kind == ("broadcast" if members == ["weights"] else "allreduce fused")
            names.update(dict.fromkeys(members, int(nbytes)))
    return names


def test_debug_shows_the_backend_each_name_once_and_each_plan(mpirun):
    proc = mpirun(2, WORKER, env={"HOROVOD_LOG_LEVEL": "debug"}, timeout=120)
    out = by_rank(proc)
    for rank in (0, 1):
        debug = logged(out[rank], rank, "DEBUG")
        backend = [message for message in debug if message.startswith("backend: ")]
        assert len(backend) == 1, out[rank]
        assert backend[0].startswith(
            "backend: hierarchical for host buffers (HOROVOD_HIERARCHICAL_ALLREDUCE=1 and 2 "
            "ranks on this node"), backend
        assert sorted(m for m in debug if ": agreed " in m) == AGREED, out[rank]
        assert set(planned(debug)) == set(TENSORS), out[rank]
        # every line of the package, its timestamp first (HOROVOD_LOG_HIDE_TIME unset)
        assert out[rank].count("hpc_horovod ") == len(debug), out[rank]
    assert_every_rank_says(proc, 2, "done")


def test_warning_shows_the_stall_and_nothing_of_debug(mpirun, monkeypatch):
    monkeypatch.delenv("HOROVOD_LOG_LEVEL", raising=False)  # the default: warning
    proc = mpirun(2, WORKER, "late", env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "1"},
                  timeout=120)
    out = by_rank(proc)
    warnings = logged(out[0], 0, "WARNING")
    assert warnings, out[0]
    assert all(w.startswith("One or more tensors were submitted") for w in warnings), out[0]
    assert "Missing ranks:\n1: [grad.0, grad.1]" in out[0], out[0]
    for rank in (0, 1):
        assert out[rank].count("hpc_horovod ") == (len(warnings) if rank == 0 else 0), \
            out[rank]
        for debug in ("DEBUG", "backend: ", "agreed", "plan of"):
            assert debug not in out[rank], out[rank]
    assert_every_rank_says(proc, 2, "done")


def test_horovodrun_log_level_reaches_the_ranks(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hpc_horovod.horovodrun", "-np", "2", "--log-level", "debug",
         "--log-hide-timestamp", "--no-hierarchical-allreduce", sys.executable, str(WORKER)],
        capture_output=True, text=True, timeout=120, env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = by_rank(proc)
    for rank in (0, 1):
        debug = logged(out[rank], rank, "DEBUG", stamp=r"\[")
        assert [m for m in debug if m.startswith("backend: ")] == [
            "backend: mpi for host buffers (HOROVOD_HIERARCHICAL_ALLREDUCE=0); device buffers: "
            "none: GPU tensors, if any, go through host memory; 2 ranks, openmpi"], out[rank]
        assert sorted(m for m in debug if ": agreed " in m) == AGREED, out[rank]
        assert set(planned(debug)) == set(TENSORS), out[rank]
