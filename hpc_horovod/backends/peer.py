"""Sums through the memory of the node's other ranks (the engine's way for float tensors of 8 MiB
and more, see ``fusion.node_sum``; smaller ones go through the shared window, :mod:`.shm`).

When every rank is on one node, a group of float tensors can be summed without staging it
anywhere: each rank publishes where its tensors are (a table of addresses, one small
``Iallgather``), then owns 1/n of the group laid end to end. It reads that slice of every peer's
inputs straight from the peer's memory, sums them with its own in rank order, and writes the
result into its own outputs and straight into every peer's (Linux cross-memory attach,
``process_vm_readv``/``process_vm_writev``: what Open MPI's shared-memory transport uses for its
single-copy messages). One barrier then says that every slice has arrived everywhere. Each byte
crosses between processes once each way, as in MPI's own two-rank allreduce, and nothing is
copied into a window and back; the kernel pins every page it copies, which the window's copies
outrun below 8 MiB.

Nobody else touches rank r's slice of anyone's tensors while rank r works on it, so no other
synchronization is needed; a peer that died is reported by the failing read or write, or by the
barrier's timeout. Cross-memory attach needs the same user and a kernel that allows it (not
every container's seccomp profile does): :meth:`PeerAllreduce.open` tries it both ways between
every pair of ranks, and every rank falls back to MPI (or the window) when one pair cannot.
"""

from __future__ import annotations

import os
import secrets

import numpy as np
from mpi4py import MPI

from ..common.errors import HorovodInternalError
from .shm import _slice_bounds
from .waiting import RequestWaiter

try:
    from .. import _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _native = None

#: dtypes the native kernel sums (float16/bfloat16 in float32, rounded once)
DTYPES = ("float16", "bfloat16", "float32", "float64")


def _probe(comm: MPI.Comm) -> tuple[list[int], bool]:
    """(every rank's pid, whether every rank can read and write every other's memory);
    collective, and the answer is the same on every rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    token = np.array([secrets.randbits(62), rank], dtype=np.int64)
    inbox = np.zeros(size, dtype=np.int64)
    usable = _native is not None  # a rank without it still takes part, and says no
    try:
        if usable:
            _native.peer_allow()
    except OSError:
        usable = False
    peers = comm.allgather((os.getpid(), token.ctypes.data, inbox.ctypes.data, token.tobytes()))
    mark = np.array([rank + 1], dtype=np.int64)
    for q, (pid, token_at, inbox_at, expected) in enumerate(peers):
        if q == rank or not usable:
            continue
        seen = np.zeros(2, dtype=np.int64)
        try:
            _native.peer_read(pid, token_at, seen)
            _native.peer_write(pid, inbox_at + 8 * rank, mark)
        except OSError:
            usable = False
        usable = usable and seen.tobytes() == expected
    comm.Barrier()  # every write into this rank's inbox has landed
    usable = usable and all(inbox[q] == q + 1 for q in range(size) if q != rank)
    return [p[0] for p in peers], comm.allreduce(usable, op=MPI.LAND)


class PeerAllreduce:
    """Sums of fused groups over ``comm``, whose ranks all share this node."""

    def __init__(self, comm: MPI.Comm, pids: list[int], waiter: RequestWaiter):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._pids = pids
        self._waiter = waiter
        self._scratch = np.empty(max(self.size - 1, 1) * _native.peer_chunk(), dtype=np.uint8)

    @classmethod
    def open(cls, comm: MPI.Comm, waiter: RequestWaiter) -> PeerAllreduce | None:
        """Collective: the reducer, or None on every rank when some pair of ranks cannot
        reach each other's memory (or some rank lacks the native extension)."""
        pids, usable = _probe(comm)
        return cls(comm, pids, waiter) if usable else None

    def allreduce(self, inputs: list[np.ndarray], outputs: list[np.ndarray], dtype: np.dtype,
                  factor: float, timeout_s: float) -> None:
        """``outputs[i] = factor x (sum over ranks of inputs[i])``, in rank order, for every i;
        an output may be its input. The arrays of every rank have the same sizes, in the same
        order. Raises HorovodInternalError when a peer cannot be reached or does not come
        within ``timeout_s`` (0: wait for ever)."""
        n = len(inputs)
        table = np.empty((n, 3), dtype=np.uint64)
        total = _native.peer_table(inputs, outputs, table)
        tables = np.empty((self.size, n, 3), dtype=np.uint64)
        what = f"allreduce of {n} tensors of {dtype} through the node's memory"
        self._waiter.wait(self.comm.Iallgather(table, tables), timeout_s, what)
        item = dtype.itemsize
        lo, hi = _slice_bounds(total // item, item, self.size, self.rank)
        try:
            _native.peer_reduce(self._pids, tables, self.rank, lo * item, hi * item, dtype.name,
                                factor, self._scratch)
        except OSError as exc:
            raise HorovodInternalError(f"{what}: {exc}") from None
        self._waiter.wait(self.comm.Ibarrier(), timeout_s, what)  # every slice has arrived
