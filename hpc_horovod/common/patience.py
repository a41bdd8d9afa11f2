"""How a thread waits for its peers: keeping its core, or leaving it.

A caller blocked in ``Engine.wait`` has nothing else to run, so while it waits for a peer it keeps
its core (spinning, then ``sched_yield``, which still lets any other thread of the core run).
Sleeping instead costs more than the wait on a virtual machine: a vCPU that goes idle even for
20 us comes back slowly (two ranks here: a 4 KiB allreduce 0.08-0.10 ms with sleeps, 0.04-0.07
ms yielding; 200 x 16 KiB 0.08-0.14 ms more per batch). The engine thread in the background
waits while the training computes on the same core, and yielding there took 8-12% of a training
step's throughput: it sleeps.
"""

from __future__ import annotations

import threading

#: How long a thread that keeps its core yields before it sleeps after all.
YIELD_S = 10e-3

_local = threading.local()


class _Caller:
    """Context of a thread that runs the engine's cycles for a result it waits for."""

    __slots__ = ()

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc_info) -> None:
        _local.depth -= 1


waiting_caller = _Caller()


def keeps_core() -> bool:
    """Whether this thread waits for peers keeping its core (inside :data:`waiting_caller`)."""
    return getattr(_local, "depth", 0) > 0
