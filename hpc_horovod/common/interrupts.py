"""Signals held while the main thread runs one of the engine's cycles.

A caller blocked in ``Engine.wait`` runs the engine's cycles itself, and the main thread is the
one where Python runs signal handlers: a KeyboardInterrupt, a signal handler's exception or
pytest-timeout's ``pytest.fail`` could otherwise cut a cycle short anywhere, leaving this rank
out of step with its peers, which wait in a collective it never reaches. While the cycle runs,
the Python handler of every signal a running program is sent (``_SIGNALS``) is replaced by one
that notes the signal; once the cycle is over the handlers are put back and the noted signals
handled, in the caller's ``wait``. The engine is
then in step everywhere and goes on working. A second signal during the same cycle (a peer that
no longer answers keeps a cycle waiting up to ``HOROVOD_PEER_TIMEOUT_SECONDS``) is handled at
once: the cycle is given up and the engine stops on every rank with a message naming this one.
"""

from __future__ import annotations

# ``_signal`` is the C module behind ``signal``, used directly: it takes and returns plain
# numbers and handlers, without the enum conversions that ``signal``'s wrappers add to each call
# (they cost more than the rest of a small allreduce's cycle).
import _signal
import threading

#: the signals whose Python handlers are held: those a user, a test runner (pytest-timeout's
#: SIGALRM) or a batch system (SLURM's SIGTERM, SIGUSR1/2 before the time limit, SIGXCPU) sends
#: to a running program. Reading every signal's handler at each cycle would cost more than the
#: cycle of a small allreduce; a handler of another signal that raises during a cycle stops the
#: engine on every rank with a message instead (Engine.wait).
_SIGNALS = [getattr(_signal, name) for name in (
    "SIGINT", "SIGTERM", "SIGALRM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGXCPU",
    "SIGVTALRM", "SIGPROF") if hasattr(_signal, name)]


class HeldSignals:
    """Context of one cycle on the main thread (a no-op on any other thread)."""

    __slots__ = ("_saved", "_held")

    def __init__(self):
        self._saved: dict[int, object] = {}
        self._held: list[tuple[int, object]] = []

    def __enter__(self) -> HeldSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        hold = self._hold
        for signum, handler in zip(_SIGNALS, map(_signal.getsignal, _SIGNALS)):
            if callable(handler):
                self._saved[signum] = handler
                _signal.signal(signum, hold)
        return self

    def _hold(self, signum, frame) -> None:
        if self._held:  # the second: handled now
            self._restore()
            self._held.clear()
            handler = _signal.getsignal(signum)
            if callable(handler):
                handler(signum, frame)
            return
        self._held.append((signum, frame))

    def _restore(self) -> None:
        saved, self._saved = self._saved, {}
        for signum, handler in saved.items():
            _signal.signal(signum, handler)

    def __exit__(self, *exc_info) -> None:
        if not self._saved:
            return
        self._restore()
        held, self._held = self._held, []
        for signum, frame in held:
            handler = _signal.getsignal(signum)
            if callable(handler):
                handler(signum, frame)
