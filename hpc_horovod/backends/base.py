"""The operations the engine needs from a backend: one communicator of one process set.

Every backend (``mpi``, ``nccl``, ``single``) implements this protocol. The engine calls these
methods from whichever thread runs its cycles (one at a time), in the same order on every member
rank. Reductions receive arrays of a dtype the backend reduces (the engine widens float16 and
bfloat16 to float32 when no native sum exists); the data-movement methods take any dtype.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Backend(Protocol):
    name: str
    rank: int
    size: int
    #: the GPU whose device buffers this backend moves itself (NCCL); None for host backends
    device: int | None = None

    # -- negotiation (host memory, small) --------------------------------------------------------
    def negotiate(self, words: np.ndarray, timeout_s: float, alarm=None) -> None:
        """In-place bitwise AND of ``words`` over the set; raise HorovodInternalError when a
        peer does not come within ``timeout_s`` (0: wait for ever), and ``alarm.error`` as soon
        as it is set while waiting."""

    def allgather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order."""

    def allgather_ints(self, values: np.ndarray) -> np.ndarray:
        """(size, len(values)) int64: every rank's ``values``."""

    def alltoall_ints(self, values: np.ndarray) -> np.ndarray:
        """int64 ``values[i]`` sent to rank i; returns what each rank sent to this one."""

    # -- data ------------------------------------------------------------------------------------
    def allreduce(self, buf, op: int, send=None) -> None:
        """Over every rank's ``buf`` (contiguous), in place; or, with ``send`` (host arrays of
        ``buf``'s shape and dtype), from ``send`` into ``buf``."""

    def allgatherv(self, send, recv, counts) -> None:
        """``recv`` = every rank's ``send`` end to end; ``counts[r]`` elements from rank r."""

    def bcast(self, buf, root: int) -> None:
        """In place, from ``root`` (a rank of this set)."""

    def alltoallv(self, send, send_counts, recv, recv_counts) -> None:
        """``send_counts[r]`` elements to rank r, ``recv_counts[r]`` from it, end to end."""

    def reduce_scatter(self, send, recv, counts, op: int) -> None:
        """Reduce ``send`` over the ranks; rank r receives the ``counts[r]`` elements of its
        block."""

    def barrier(self) -> None:
        """Wait until every rank of the set arrives."""

    # -- health and lifetime -----------------------------------------------------------------------
    def check_async_error(self) -> None:
        """Raise when the backend saw an asynchronous failure (NCCL: a lost peer or link);
        the host backends have none, and inherit this no-op."""

    def abort(self) -> None:
        """After an engine error: end this set's device communicators at once, so that no
        device work waits for ever on a peer that is gone (NCCL: ``ncclCommAbort``); the host
        backends have none, and inherit this no-op."""

    def sub(self, ranks) -> Backend | None:
        """Collective over this set: a backend for ``ranks`` (None on a rank outside them)."""

    def free(self) -> None:
        """Release the communicator; local (never waits for a peer)."""
