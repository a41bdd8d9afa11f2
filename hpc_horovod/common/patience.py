"""How a rank's threads wait for its peers: keeping their core, or leaving it.

While a thread of the rank waits for a result (``Engine.wait``), the rank has nothing else to
run, so whoever runs the engine's cycles meanwhile (that caller, or the engine thread) keeps its
core while waiting for a peer: spinning, then ``sched_yield``, which still lets any other thread
of the core run. Sleeping instead costs more than the wait itself where an idle CPU (a virtual
one above all) is slow to come back. When nobody waits, the engine thread works in the
background while the training computes on the same core: there spinning or yielding would take
the core from the training, so it sleeps from the first look on. Which of the two applies is
looked up at every pause, not fixed when the wait began: a wait the engine thread began in the
background (a gradient bucket's, during backward) yields from the moment the training thread
waits for its result, rather than sleeping on between its looks at the peers.
"""

from __future__ import annotations

import os
import threading
import time

#: How long a wait that keeps its core spins first (a peer a few microseconds away).
SPIN_S = 50e-6
#: How long a wait that keeps its core yields before it sleeps after all.
YIELD_S = 10e-3

#: threads inside waiting_caller, changed under _count_lock (the policy of every counter
#: several threads change: ``common/engine.py``'s docstring)
_waiting = 0
_count_lock = threading.Lock()


class _Caller:
    """Context of a thread that waits for a result of the engine (nestable)."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _waiting
        with _count_lock:
            _waiting += 1

    def __exit__(self, *exc_info) -> None:
        global _waiting
        with _count_lock:
            _waiting -= 1


waiting_caller = _Caller()


def keeps_core() -> bool:
    """Whether waits for peers keep the core now: some thread of this rank waits for a result."""
    return _waiting > 0


class Pace:
    """The pace of one wait for peers, begun at ``start``. The waiter looks, and while
    ``spinning(now)`` looks again at once; otherwise it checks its deadline and calls
    :meth:`pause`. A wait that keeps the core from its first look spins ``SPIN_S`` first; any
    pause yields while some thread waits for a result and the wait is younger than ``YIELD_S``,
    and sleeps otherwise."""

    __slots__ = ("start", "_spin_until")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self._spin_until = self.start + SPIN_S if keeps_core() else 0.0

    def spinning(self, now: float) -> bool:
        return now < self._spin_until

    def yields(self, now: float) -> bool:
        """Whether a pause now keeps the core (yields) rather than leaves it: some thread waits
        for a result, and the wait is younger than ``YIELD_S``."""
        return bool(_waiting) and now - self.start < YIELD_S

    def pause(self, now: float) -> None:
        """Yield the core, or sleep a little (longer once the wait is long)."""
        if self.yields(now):
            os.sched_yield()
        else:
            time.sleep(20e-6 if now - self.start < 0.01 else 200e-6)
