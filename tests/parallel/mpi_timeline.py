"""HOROVOD_TIMELINE, run by every rank of ``mpirun -np N python -m pytest`` (test_timeline.py): a
valid Chrome trace written by rank 0 only, with Horovod's event names and one row ("process")
per tensor; HOROVOD_TIMELINE=DYNAMIC records only between ``start_timeline`` and
``stop_timeline`` (or ``shutdown``)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

import hpc_horovod as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


@pytest.fixture
def timeline(monkeypatch):
    """``timeline(value)``: the engine started again with HOROVOD_TIMELINE=value; the default
    engine again afterwards."""
    def start(value: str) -> None:
        monkeypatch.setenv("HOROVOD_TIMELINE", value)
        hvd.shutdown()
        hvd.init()

    yield start
    hvd.shutdown()
    monkeypatch.undo()
    hvd.init()


def rows(events: list[dict]) -> dict[int, str]:
    """pid -> tensor name, from the ``process_name`` metadata events."""
    return {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}


def spans(events: list[dict], pid: int) -> list[str]:
    """The names of the begin/complete events of one row, in order."""
    return [e["name"] for e in events if e.get("pid") == pid and e.get("ph") in ("B", "X")]


def test_static(timeline):
    static = Path(tempfile.mkdtemp()) / "static" / "timeline.json"
    timeline(str(static))
    for _ in range(3):
        hvd.allreduce(np.ones(16, np.float32), name="grad.w")
        hvd.allreduce(np.ones(4, np.float32), name="grad.b")
    hvd.allgather(np.ones((RANK + 1, 2)), name="gathered")
    hvd.broadcast(np.ones(3), root_rank=0, name="weights")
    hvd.alltoall(np.ones(SIZE), name="exchanged")
    hvd.reducescatter(np.ones(SIZE), name="scattered")
    hvd.allreduce(np.ones(4), op=hvd.Adasum, name="adasum")
    hvd.shutdown()
    if RANK != 0:
        assert not static.parent.exists(), "a rank other than 0 wrote a timeline"
        return
    assert [p.name for p in static.parent.iterdir()] == ["timeline.json"]
    events = json.loads(static.read_text())  # valid JSON after shutdown
    names = rows(events)
    assert sorted(names.values()) == sorted(
        ["grad.w", "grad.b", "gathered", "weights", "exchanged", "scattered", "adasum"])
    assert len(set(names)) == len(names)  # one row per tensor
    by_name = {name: spans(events, pid) for pid, name in names.items()}
    # three steps of grad.w: negotiate, then the op holding the MPI call
    assert by_name["grad.w"] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE"] * 3
    assert by_name["gathered"] == ["NEGOTIATE_ALLGATHER", "ALLGATHER", "MPI_ALLGATHER"]
    assert by_name["weights"] == ["NEGOTIATE_BROADCAST", "BROADCAST", "MPI_BCAST"]
    assert by_name["exchanged"] == ["NEGOTIATE_ALLTOALL", "ALLTOALL", "MPI_ALLTOALL"]
    assert by_name["scattered"] == ["NEGOTIATE_REDUCESCATTER", "REDUCESCATTER",
                                    "MPI_REDUCESCATTER"]
    assert by_name["adasum"][:2] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"]
    for event in events:
        assert event["ph"] in ("M", "B", "E", "X", "i")
        if event["ph"] != "M":
            assert isinstance(event["ts"], int) and event["ts"] >= 0
    for pid in names:  # every begun span ends, per row
        row = [e["ph"] for e in events if e.get("pid") == pid]
        assert row.count("B") == row.count("E")


def test_dynamic(timeline):
    """Only what ran between start_timeline and stop_timeline (or shutdown)."""
    dynamic = Path(tempfile.mkdtemp()) / "dynamic.json"
    timeline("DYNAMIC")
    hvd.allreduce(np.ones(8), name="before.start")
    hvd.start_timeline(str(dynamic))
    hvd.allreduce(np.ones(8), name="while.recording")
    hvd.allgather(np.ones(2), name="gather.while.recording")
    hvd.stop_timeline()
    hvd.allreduce(np.ones(8), name="after.stop")
    hvd.start_timeline(str(dynamic) + ".second")
    hvd.allreduce(np.ones(8), name="second.recording")
    hvd.shutdown()  # closes the open timeline
    if RANK != 0:
        assert not dynamic.exists(), "a rank other than 0 wrote a timeline"
        return
    first = rows(json.loads(dynamic.read_text()))
    assert sorted(first.values()) == ["gather.while.recording", "while.recording"]
    second = rows(json.loads(Path(str(dynamic) + ".second").read_text()))
    assert list(second.values()) == ["second.recording"]
