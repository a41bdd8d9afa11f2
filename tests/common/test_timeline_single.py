"""The timeline of a job of size 1 (``HOROVOD_TIMELINE``): every op under its name, with its
negotiation and its execution."""

from __future__ import annotations

import numpy as np
from support import leave_launchers

import hpc_horovod as hvd


# -- timeline -------------------------------------------------------------------------------------
def test_timeline_in_one_process(monkeypatch, tmp_path):
    import json

    hvd.shutdown()
    leave_launchers(monkeypatch)
    path = tmp_path / "sub" / "timeline.json"
    monkeypatch.setenv("HOROVOD_TIMELINE", str(path))
    hvd.init()
    try:
        hvd.allreduce(np.ones(4), name="w")
        hvd.allgather(np.ones(4), name="g")
    finally:
        hvd.shutdown()
    events = json.loads(path.read_text())
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"w", "g"} <= names
    kinds = {e.get("name") for e in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MPI_ALLREDUCE", "NEGOTIATE_ALLGATHER",
            "ALLGATHER", "MPI_ALLGATHER"} <= kinds
