"""HOROVOD_TIMELINE over 2 ranks: a valid Chrome trace written by rank 0, with Horovod's event
names and one row ("process") per tensor; HOROVOD_TIMELINE=DYNAMIC records only between
``start_timeline`` and ``stop_timeline``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HERE = Path(__file__).parent
pytestmark = pytest.mark.mpi


def rows(events: list[dict]) -> dict[int, str]:
    """pid -> tensor name, from the ``process_name`` metadata events."""
    return {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}


def spans(events: list[dict], pid: int) -> list[str]:
    """The names of the begin/complete events of one row, in order."""
    return [e["name"] for e in events if e.get("pid") == pid and e.get("ph") in ("B", "X")]


def test_timeline_static_and_dynamic(mpirun, tmp_path):
    static, dynamic = tmp_path / "static" / "timeline.json", tmp_path / "dynamic.json"
    proc = mpirun(2, HERE / "timeline_worker.py", static, dynamic, timeout=120,
                  env={"HOROVOD_TIMELINE": str(static)})
    assert "rank 0: timeline ok" in proc.stdout and "rank 1: timeline ok" in proc.stdout
    check_static(static)
    check_dynamic(dynamic)


def check_static(static: Path) -> None:
    assert [p.name for p in static.parent.iterdir()] == ["timeline.json"]  # rank 0 only
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
    # every begun span ends, per row
    for pid in names:
        row = [e["ph"] for e in events if e.get("pid") == pid]
        assert row.count("B") == row.count("E")


def check_dynamic(dynamic: Path) -> None:
    """Only what ran between start_timeline and stop_timeline (or shutdown)."""
    first = rows(json.loads(dynamic.read_text()))
    assert sorted(first.values()) == ["gather.while.recording", "while.recording"]
    second = rows(json.loads(Path(str(dynamic) + ".second").read_text()))
    assert list(second.values()) == ["second.recording"]  # closed by shutdown()
