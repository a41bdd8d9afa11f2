"""Gradient buckets, one module for torch and TensorFlow: which gradients share a bucket
(:func:`assign`), how a list splits into groups (:func:`split`), the bucket size knob (from
the runtime's settings), and the memory a bucket lives in (:func:`shared_memory`: the node's
shared window when the host backend has one, so that the allreduce reads it where it lies).

Assignment is torch DDP's: gradients in the order backward produces them, each appended to the
open bucket of its kind (dtype and device), which closes once it holds the cap; the first bucket
of each kind closes at ``first_cap`` (DDP's 1 MiB first bucket, so that the first reduction
starts early). A gradient whose size is unknown until it runs goes alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from . import basics

#: the first bucket of each kind closes at this many bytes (as DDP's first bucket)
FIRST_BUCKET_BYTES = 1024 * 1024


def bucket_bytes() -> int:
    """``HOROVOD_BUCKET_BYTES`` from the settings of the running ``init``, as every knob."""
    return basics.settings().bucket_bytes


def assign(items: Sequence[tuple[Hashable, int | None]], cap: float,
           first_cap: float | None = None) -> list[list[int]]:
    """Positions of ``items`` (``(kind, nbytes)``, in the order their gradients become ready;
    ``nbytes`` None: unknown until run time) in buckets; see the module's docstring."""
    first_cap = cap if first_cap is None else first_cap
    closed, open_buckets, started = [], {}, set()
    for i, (kind, nbytes) in enumerate(items):
        if nbytes is None:
            closed.append([i])
            continue
        bucket = open_buckets.setdefault(kind, [[], 0])
        bucket[0].append(i)
        bucket[1] += nbytes
        if bucket[1] >= (cap if kind in started else first_cap):
            closed.append(bucket[0])
            started.add(kind)
            del open_buckets[kind]
    return closed + [b[0] for b in open_buckets.values()]


def split(items: list, n: int) -> list[list]:
    """``n`` consecutive chunks of nearly equal length (Horovod's split_list); empty ones are
    dropped."""
    d, r = divmod(len(items), n)
    chunks = [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]
    return [c for c in chunks if c]


def shared_memory(process_set_id: int, nbytes: int) -> np.ndarray | None:
    """``nbytes`` (uint8) of the process set's host backend's shared window, which its
    allreduce reduces where it lies; None when the backend has none (or none left)."""
    backend = basics.engine().process_set_backend(process_set_id)
    return None if backend is None else backend.bucket_memory(nbytes)
