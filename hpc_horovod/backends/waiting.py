"""Waiting for a non-blocking MPI request: a short spin, then yields or short sleeps, and a
deadline.

A blocking collective spins a core at 100% while a peer computes (on a node with one core per
rank that steals the core the peer's own training needs) and never gives up on a peer that died.
Polling with a back-off costs microseconds and turns a dead peer into an error. While a thread
of the rank waits for a result, waits yield the core rather than sleep (``common.patience``).
"""

from __future__ import annotations

import time

from ..common import patience
from ..common.errors import HorovodInternalError

#: Requests given up on, and the backends of engines that failed. A peer that comes late still
#: completes such a request, and MPI then writes into its receive buffer through its
#: communicator: neither may be freed. mpi4py's request keeps neither alive (freeing the
#: request object frees the MPI request, and drops its buffer): whoever posts it keeps the
#: buffer, and the backend that holds both is kept here after a failure.
abandoned: list = []


class RequestWaiter:
    """Waits for the requests of one communicator of ``size`` ranks."""

    def __init__(self, size: int):
        self.size = size

    def wait(self, req, timeout_s: float, what: str, alarm=None) -> None:
        """Return once ``req`` completes; raise HorovodInternalError after ``timeout_s``
        (0: never) naming ``what`` was waited for and, through ``alarm.census``, the ranks
        that did not answer; or ``alarm.error`` as soon as it is set (a peer was lost or
        failed: see ``common.watch``).

        A wait that ends without the request (a timeout, the alarm, an interrupt such as
        KeyboardInterrupt or a signal handler's exception) gives the request up for good: it
        is kept alive here, since MPI may still complete it (its buffers are the caller's to
        keep)."""
        if req.Test():
            return
        try:
            self._wait(req, timeout_s, what, alarm)
        except BaseException:
            abandoned.append(req)
            raise

    def _wait(self, req, timeout_s: float, what: str, alarm) -> None:
        pace = patience.Pace()
        while not req.Test():
            now = time.perf_counter()
            if pace.spinning(now):
                continue
            if alarm is not None and alarm.error is not None:
                raise alarm.error.copy()
            if timeout_s and now - pace.start > timeout_s:
                raise no_answer(self.size, timeout_s, what, alarm)
            pace.pause(now)


def no_answer(size: int, timeout_s: float, what: str, alarm,
              late: str = "a peer process is blocked outside Python, or its host stopped "
                          "answering") -> HorovodInternalError:
    """The error of a wait for peers past its deadline: with a side channel (``alarm.census``,
    see ``common.watch``) it names the ranks that did not answer and where the others are;
    without one, ``late`` says what the waiter knows."""
    census = getattr(alarm, "census", None)
    where = census() if census is not None else late
    return HorovodInternalError(
        f"no answer from some of the {size} ranks for {timeout_s:.0f} s ({what}): {where} "
        "(raise HOROVOD_PEER_TIMEOUT_SECONDS if a rank legitimately stops for longer)")
