"""Chrome-tracing timeline (``HOROVOD_TIMELINE=file.json``), written by rank 0.

Horovod's layout: one trace "process" per tensor name, with a ``NEGOTIATE_<OP>`` span while the
ranks agree, then the ``<OP>`` span holding the activities (``MEMCPY_IN_FUSION_BUFFER``,
``MPI_ALLREDUCE``...). Events are streamed to the file; ``close`` writes the closing bracket so
the file is valid JSON after ``stop_timeline()``, ``shutdown()`` or a normal exit.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager

_ACTIVITY = {"ALLREDUCE": "MPI_ALLREDUCE", "ALLGATHER": "MPI_ALLGATHER",
             "BROADCAST": "MPI_BCAST", "ALLTOALL": "MPI_ALLTOALL",
             "REDUCESCATTER": "MPI_REDUCESCATTER", "BARRIER": "MPI_BARRIER"}


class Timeline:
    def __init__(self, path: str, mark_cycles: bool = False, backend_name: str = "mpi"):
        self.path = path
        self.mark_cycles = mark_cycles
        self.prefix = "NCCL_" if backend_name == "nccl" else "MPI_"
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._file.write("[\n")
        self._first = True
        self._pids: dict[str, int] = {}
        self._kinds: dict[str, str] = {}
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._closed = False

    def _us(self) -> int:
        return int((time.perf_counter() - self._t0) * 1e6)

    def _emit(self, event: dict) -> None:
        with self._lock:
            if self._closed:
                return
            if not self._first:
                self._file.write(",\n")
            self._first = False
            self._file.write(json.dumps(event, separators=(",", ":")))

    def _pid(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            self._emit({"name": "process_name", "ph": "M", "pid": pid,
                        "args": {"name": name}})
            self._emit({"name": "process_sort_index", "ph": "M", "pid": pid,
                        "args": {"sort_index": pid}})
        return pid

    def negotiate_start(self, name: str, kind: str) -> None:
        self._kinds[name] = kind.upper()
        self._emit({"name": f"NEGOTIATE_{kind.upper()}", "ph": "B", "ts": self._us(),
                    "pid": self._pid(name), "tid": 1})

    def negotiate_end(self, name: str) -> None:
        if name in self._kinds:
            self._emit({"ph": "E", "ts": self._us(), "pid": self._pid(name), "tid": 1})

    def op_start(self, name: str, op: str) -> None:
        self._emit({"name": op, "ph": "B", "ts": self._us(), "pid": self._pid(name), "tid": 1})

    def op_end(self, name: str) -> None:
        self._kinds.pop(name, None)
        self._emit({"ph": "E", "ts": self._us(), "pid": self._pid(name), "tid": 1})

    @contextmanager
    def activity(self, names: list[str], op: str):
        """The backend call for a group; fused allreduces also show the buffer copies."""
        label = self.prefix + _ACTIVITY.get(op, op)[4:] if op in _ACTIVITY else op
        fused = op == "ALLREDUCE" and len(names) > 1
        start = self._us()
        yield
        end = self._us()
        for name in names:
            pid = self._pid(name)
            if fused:
                self._emit({"name": "MEMCPY_IN_FUSION_BUFFER", "ph": "X", "ts": start,
                            "dur": 0, "pid": pid, "tid": 1})
            self._emit({"name": label, "ph": "X", "ts": start, "dur": max(end - start, 1),
                        "pid": pid, "tid": 1, "args": {"fused_tensors": len(names)}})

    def mark_cycle(self) -> None:
        self._emit({"name": "CYCLE_START", "ph": "i", "ts": self._us(), "s": "g", "pid": 0,
                    "tid": 0})

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._file.write("\n]\n")
            self._file.close()
