"""Output that reaches a job's log as it is printed.

Python writes its standard output in blocks of 8 KiB when it goes to a file or a pipe, which is
where ``srun`` and ``mpirun`` send it: a training script that prints a line per step would show
nothing in its ``.out`` file until the block fills or the job ends. ``hvd.init()`` calls
:func:`line_buffered` so that each line goes out when it is printed, as on a terminal, however
the script was started (the generated job scripts also export ``PYTHONUNBUFFERED=1``, which
covers the output before ``hvd.init()``).
"""

from __future__ import annotations

import io
import sys

from .topology import SINGLE


def line_buffered(launcher: str) -> None:
    """Under a launcher, make ``sys.stdout`` and ``sys.stderr`` write each line when it is
    printed, unless they are a terminal (already line-buffered) or not a text stream that can
    be reconfigured (a notebook's, a test's capture)."""
    if launcher == SINGLE:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is None or stream.isatty():
                continue
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError, io.UnsupportedOperation):
            continue
