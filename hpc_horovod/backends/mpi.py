"""mpi4py backend: host buffers over MPI.

The negotiation collective is non-blocking and polled with a short back-off: a blocking
Allreduce would spin a core at 100% while a peer computes, and on a node with one core per rank
that steals the core the peer's own training needs.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
from mpi4py import MPI

from ..common.errors import HorovodInternalError
from ..common.types import HALF_DTYPES, OP_NAMES, Max, Min, Product, Sum

_OPS = {Sum: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}
_BOOL_OPS = {Min: MPI.LAND, Max: MPI.LOR}


def _tight_sleeps() -> None:
    """Ask Linux for 1 us timer slack on this thread so the back-off sleeps last microseconds,
    not the default 50 us (PR_SET_TIMERSLACK)."""
    try:
        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _bytes(a: np.ndarray):
    return a.reshape(-1).view(np.uint8)


_HALF_SUMS: dict[np.dtype, MPI.Op] = {}


def _half_sum(dtype: np.dtype, op: int) -> MPI.Op:
    """The native float16/bfloat16 sum (src_native/). The engine sends 16-bit floats only for
    sums, and only when ``_native.has_half_sum()``; Min/Max/Product travel as float32."""
    if op != Sum:
        raise ValueError(f"MPI has no {dtype} {OP_NAMES.get(op, op)}: reduce it in float32")
    mpi_op = _HALF_SUMS.get(dtype)
    if mpi_op is None:
        from .. import _native

        mpi_op = _HALF_SUMS[dtype] = MPI.Op.fromhandle(_native.half_sum_op(dtype.name))
    return mpi_op


def _halves(a: np.ndarray) -> list:
    """A 16-bit float buffer as MPI sees it: 2-byte integers the native op reads as floats."""
    return [a.reshape(-1).view(np.uint16), MPI.UINT16_T]


class MpiBackend:
    name = "mpi"

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._slack_threads: set[int] = set()  # threads that ran _tight_sleeps

    # -- negotiation ---------------------------------------------------------------------------
    def negotiate(self, words: np.ndarray, timeout_s: float) -> None:
        """In-place bitwise AND of ``words`` over the set; raise if peers never arrive."""
        req = self.comm.Iallreduce(MPI.IN_PLACE, words, op=MPI.BAND)
        if req.Test():
            return
        if threading.get_ident() not in self._slack_threads:  # the engine's, or a waiter's
            _tight_sleeps()
            self._slack_threads.add(threading.get_ident())
        start = time.perf_counter()
        spin_until = start + 50e-6
        while not req.Test():
            now = time.perf_counter()
            if now < spin_until:
                continue
            if timeout_s and now - start > timeout_s:
                raise HorovodInternalError(
                    f"no answer from some of the {self.size} ranks for {timeout_s:.0f} s: a "
                    "peer process died or is blocked outside Python (raise "
                    "HOROVOD_PEER_TIMEOUT_SECONDS if a rank legitimately stops for longer)"
                )
            time.sleep(20e-6 if now - start < 0.01 else 200e-6)

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def allgather_ints(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values, dtype=np.int64)
        out = np.empty((self.size, values.size), dtype=np.int64)
        self.comm.Allgather(values, out)
        return out

    def alltoall_ints(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values, dtype=np.int64)
        out = np.empty_like(values)
        self.comm.Alltoall(values, out)
        return out

    # -- data ------------------------------------------------------------------------------------
    def allreduce(self, buf: np.ndarray, op: int) -> None:
        if buf.dtype in HALF_DTYPES:
            self.comm.Allreduce(MPI.IN_PLACE, _halves(buf), op=_half_sum(buf.dtype, op))
            return
        mpi_op = _BOOL_OPS[op] if buf.dtype == np.bool_ else _OPS[op]
        self.comm.Allreduce(MPI.IN_PLACE, buf.reshape(-1), op=mpi_op)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts) -> None:
        item = send.dtype.itemsize
        byte_counts = [c * item for c in counts]
        displs = np.concatenate(([0], np.cumsum(byte_counts)[:-1])).tolist()
        self.comm.Allgatherv(_bytes(send), [_bytes(recv), byte_counts, displs, MPI.BYTE])

    def bcast(self, buf: np.ndarray, root: int) -> None:
        self.comm.Bcast(_bytes(buf), root=root)

    def alltoallv(self, send, send_counts, recv, recv_counts) -> None:
        item = send.dtype.itemsize
        sc = [c * item for c in send_counts]
        rc = [c * item for c in recv_counts]
        sd = np.concatenate(([0], np.cumsum(sc)[:-1])).tolist()
        rd = np.concatenate(([0], np.cumsum(rc)[:-1])).tolist()
        self.comm.Alltoallv([_bytes(send), sc, sd, MPI.BYTE], [_bytes(recv), rc, rd, MPI.BYTE])

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts, op: int) -> None:
        if send.dtype in HALF_DTYPES:
            self.comm.Reduce_scatter(_halves(send), _halves(recv), list(counts),
                                     op=_half_sum(send.dtype, op))
            return
        mpi_op = _BOOL_OPS[op] if send.dtype == np.bool_ else _OPS[op]
        self.comm.Reduce_scatter(send.reshape(-1), recv.reshape(-1), list(counts), op=mpi_op)

    def barrier(self) -> None:
        self.comm.Barrier()

    # -- process sets ----------------------------------------------------------------------------
    def sub(self, ranks) -> MpiBackend | None:
        """Collective over this communicator: a backend for ``ranks`` (None on non-members)."""
        group = self.comm.Get_group().Incl(list(ranks))
        comm = self.comm.Create_group(group)
        group.Free()
        return None if comm == MPI.COMM_NULL else MpiBackend(comm)

    def free(self) -> None:
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_NULL):
            self.comm.Free()


def library_version() -> str:
    return MPI.Get_library_version().strip().splitlines()[0]
