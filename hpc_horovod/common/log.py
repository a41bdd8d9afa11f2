"""The package's one logger, ``hpc_horovod``, set up by ``init`` from ``HOROVOD_LOG_LEVEL``.

Horovod's levels (``trace``, ``debug``, ``info``, ``warning``, ``error``, ``fatal``; default
``warning``) map onto Python's :mod:`logging`: ``trace`` is :data:`TRACE`, below ``DEBUG``;
``fatal`` is ``CRITICAL``. Every line goes to ``sys.stderr`` (whatever it is when the line is
written), tagged with the rank and the host that wrote it, after a timestamp as Horovod's are
unless ``HOROVOD_LOG_HIDE_TIME`` is set::

    [2026-01-31 12:00:00.123456: hpc_horovod 1@node2] WARNING: ...

What each level adds: ``warning`` shows what needs the user's attention (stalls, a rank that
exits, the job's failure); ``info`` nothing more yet; ``debug`` the backend chosen and why,
each name the ranks agree on, once, and each plan of agreed tensors when it is built; ``trace``
also each cycle's negotiation.

Only this logger is configured, with a handler of its own and ``propagate`` off: the root
logger, and the user's own logging, stay as they were.
"""

from __future__ import annotations

import logging
import sys
import time

#: Horovod's TRACE, below logging.DEBUG
TRACE = 5
#: Horovod's level names -> logging's levels
LEVELS = {"trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO,
          "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}
_NAMES = {level: name.upper() for name, level in LEVELS.items()}

log = logging.getLogger("hpc_horovod")


class _Stderr(logging.StreamHandler):
    """Writes each line to the ``sys.stderr`` of the moment, in one write, flushed (as the
    ``print(..., file=sys.stderr, flush=True)`` it replaces): a test's capture or a redirected
    stream gets it too."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


class _Format(logging.Formatter):
    """``[time: hpc_horovod rank@host] LEVEL: message``, time left out when hidden."""

    def __init__(self, tag: str, hide_time: bool) -> None:
        super().__init__()
        self._tag = tag
        self._hide_time = hide_time

    def format(self, record: logging.LogRecord) -> str:
        level = _NAMES.get(record.levelno, record.levelname)
        text = f"{self._tag}] {level}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if self._hide_time:
            return "[" + text
        micros = int(record.created * 1e6) % 1_000_000
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        return f"[{stamp}.{micros:06d}: {text}"


def configure(settings, rank: int, host: str) -> None:
    """Set the ``hpc_horovod`` logger to ``settings.log_level`` (a key of :data:`LEVELS`,
    checked by ``Settings``) with one handler of its own, tagged ``rank@host``, timestamped
    unless ``settings.log_hide_time``; a later call (the next ``init``) replaces that
    handler."""
    for handler in [h for h in log.handlers if isinstance(h, _Stderr)]:
        log.removeHandler(handler)
    handler = _Stderr()
    handler.setFormatter(_Format(f"hpc_horovod {rank}@{host.split('.')[0]}",
                                 settings.log_hide_time))
    log.addHandler(handler)
    log.setLevel(LEVELS[settings.log_level])
    log.propagate = False
