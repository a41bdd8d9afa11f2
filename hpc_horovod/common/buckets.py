"""Gradient buckets, one module for torch and TensorFlow: which gradients share a bucket
(:func:`assign`), how a list splits into groups (:func:`split`), the bucket size knob (from
the runtime's settings), and the memory a bucket lives in (:func:`shared_memory`: the node's
shared window when the host backend has one, so that the allreduce reads it where it lies).

Assignment is torch DDP's: gradients in the order backward produces them, each appended to the
open bucket of its kind (dtype and device), which closes once it holds the cap; the first bucket
of each kind closes at ``first_cap`` (DDP's 1 MiB first bucket, so that the first reduction
starts early). A gradient whose size is unknown until it runs goes alone.

The same rule mirrored keeps the end of backward short: with ``last_cap``, the gradients produced
last (of each kind) go in a bucket of their own of at most ``last_cap`` bytes, or alone when the
very last is larger. Nothing overlaps the reduction of the last bucket, and the bucket before it
no longer waits for the last gradient: it starts while backward still computes the last layers.
Gradients that come out of backward together (a layer's weight and bias: ``together`` gives them
one key) stay on one side of that cut, else the bucket before would wait for the last layer too.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from . import basics

#: the first bucket of each kind closes at this many bytes (as DDP's first bucket)
FIRST_BUCKET_BYTES = 1024 * 1024
#: the last bucket of each kind holds at most this many bytes (see the module's docstring)
LAST_BUCKET_BYTES = 1024 * 1024


def bucket_bytes() -> int:
    """``HOROVOD_BUCKET_BYTES`` from the settings of the running ``init``, as every knob."""
    return basics.settings().bucket_bytes


def assign(items: Sequence[tuple[Hashable, int | None]], cap: float,
           first_cap: float | None = None, last_cap: float | None = None,
           together: Sequence[Hashable] | None = None) -> list[list[int]]:
    """Positions of ``items`` (``(kind, nbytes)``, in the order their gradients become ready;
    ``nbytes`` None: unknown until run time) in buckets; see the module's docstring.
    ``together``: a key per item; consecutive items of one kind with the same key are produced
    together (default: every item on its own)."""
    first_cap = cap if first_cap is None else first_cap
    tails = _tails(items, last_cap, together) if last_cap else {}  # 0: one gradient a bucket
    in_tail = {i for tail in tails.values() for i in tail}
    closed, open_buckets, started = [], {}, set()
    for i, (kind, nbytes) in enumerate(items):
        if i in in_tail:
            continue
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
    return closed + [b[0] for b in open_buckets.values()] + list(tails.values())


def _tails(items: Sequence[tuple[Hashable, int | None]], last_cap: float,
           together: Sequence[Hashable] | None) -> dict[Hashable, list[int]]:
    """Kind -> positions of its last bucket: its last items, whole runs of one ``together``
    key, up to ``last_cap`` bytes (the last run whatever its size). Items of unknown size go
    alone, so a tail stops at one."""
    tails, done = {}, set()
    i = len(items) - 1
    while i >= 0:
        kind, nbytes = items[i]
        if kind in done or nbytes is None:
            done.add(kind)
            i -= 1
            continue
        key = i if together is None else together[i]
        run, size, j = [], 0, i
        while j >= 0 and items[j][0] == kind and items[j][1] is not None and \
                (together is None and j == i or together is not None and together[j] == key):
            run.append(j)
            size += items[j][1]
            j -= 1
        tail = tails.setdefault(kind, [[], 0])
        if tail[0] and tail[1] + size > last_cap:
            done.add(kind)
        else:
            tail[0][:0] = run[::-1]
            tail[1] += size
            if tail[1] >= last_cap:
                done.add(kind)
        i = j
    return {kind: positions for kind, (positions, _) in tails.items()}


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
