"""mpi4py backend: host buffers over MPI.

The negotiation collective is non-blocking and polled with a short back-off (:mod:`.waiting`),
so a peer that died or stopped answering becomes an error instead of a hang. The data
collectives are blocking calls, which Open MPI runs with faster algorithms than its
non-blocking ones for all but small buffers; the engine records each one's deadline and the
watch's thread bounds it (``common.whereabouts``, ``common.watch``).
"""

from __future__ import annotations

import pickle

import numpy as np
from mpi4py import MPI

from ..common.types import HALF_DTYPES, OP_NAMES, Max, Min, Product, Sum
from .base import Backend
from .scaling import scale_inplace, scale_into
from .waiting import RequestWaiter

try:
    from .. import _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _native = None

_OPS = {Sum: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}
_BOOL_OPS = {Min: MPI.LAND, Max: MPI.LOR}


#: Open MPI 4.1's AVX reductions (its ``op/avx`` component, on by default) saturate sums of 8-
#: and 16-bit integers of 16 elements or more instead of wrapping (open-mpi/ompi#8045, left
#: as is on 4.1.x), so 200 + 200 gives 255 in uint8 there and 144 for fewer elements, as numpy
#: and torch wrap. These travel widened to 64 bits and wrap when narrowed back; turning the
#: component off instead would slow every float reduction down.
_WRAPPED_OPS = (Sum, Product)


def _wraps_badly(dtype: np.dtype, op: int) -> bool:
    return dtype.kind in "iu" and dtype.itemsize <= 2 and op in _WRAPPED_OPS


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
        mpi_op = _HALF_SUMS[dtype] = MPI.Op.fromhandle(_native.half_sum_op(dtype.name))
    return mpi_op


def _halves(a: np.ndarray) -> list:
    """A 16-bit float buffer as MPI sees it: 2-byte integers the native op reads as floats."""
    return [a.reshape(-1).view(np.uint16), MPI.UINT16_T]


class MpiBackend(Backend):
    name = "mpi"

    def __init__(self, comm: MPI.Comm):
        """Over ``comm``, which this backend owns from now on (``free`` releases it)."""
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._waiter = RequestWaiter(self.size)
        self._words: np.ndarray | None = None  # the buffer of the last negotiation
        self._kept: tuple = ()  # those of the last agree and allgather_ints
        self._kept_ints: tuple = ()

    # -- negotiation ---------------------------------------------------------------------------
    def negotiate(self, words: np.ndarray, timeout_s: float, alarm=None) -> None:
        """In-place bitwise AND of ``words`` over the set; raise if peers never arrive, or
        as soon as ``alarm.error`` is set."""
        # MPI writes into ``words`` until every rank posted this negotiation, and the request
        # does not keep its buffer alive: a wait given up on (or interrupted between the post
        # and the wait) leaves the buffer to the backend, which a failed engine keeps for the
        # life of the process (``Engine.abandon_backends``).
        self._words = words
        req = self.comm.Iallreduce(MPI.IN_PLACE, words, op=MPI.BAND)
        self._waiter.wait(req, timeout_s, "negotiation", alarm)

    def agree(self, obj, decide, timeout_s: float = 0.0, alarm=None):
        """A gather to rank 0 and a broadcast of its decision: each rank sends its ``obj``
        once and receives one decision, where an allgather would give every rank every
        rank's ``obj`` (bytes growing as the square of the ranks) and open a connection
        between every pair of nodes at once. Waits as :meth:`negotiate`'s do (a peer that
        fails or is lost meanwhile ends the wait)."""
        label = "exchange of pending names"
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        root = self.rank == 0
        mine = np.array([data.size], np.int64)
        sizes = np.empty(self.size if root else 0, np.int64)
        # as ``words`` in negotiate: MPI may write into these after a wait is given up on
        self._kept = (data, mine, sizes)
        self._waiter.wait(self.comm.Igather(mine, sizes, root=0), timeout_s, label, alarm)
        displs = np.concatenate(([0], np.cumsum(sizes)[:-1])) if root else sizes
        out = np.empty(int(sizes.sum()), np.uint8)
        self._kept = (data, out)
        recv = [out, sizes.tolist(), displs.tolist(), MPI.BYTE] if root else None
        self._waiter.wait(self.comm.Igatherv(data, recv, root=0), timeout_s, label, alarm)
        if root:
            gathered = [pickle.loads(out[a:a + n]) for a, n in zip(displs.tolist(),
                                                                     sizes.tolist())]
            decision = np.frombuffer(pickle.dumps(decide(gathered),
                                                  protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
            length = np.array([decision.size], np.int64)
        else:
            length = np.zeros(1, np.int64)
        self._kept = (length,)
        self._waiter.wait(self.comm.Ibcast(length, root=0), timeout_s, label, alarm)
        if not root:
            decision = np.empty(int(length[0]), np.uint8)
        self._kept = (decision,)
        self._waiter.wait(self.comm.Ibcast(decision, root=0), timeout_s, label, alarm)
        return pickle.loads(decision)

    def allgather_ints(self, values: np.ndarray, timeout_s: float = 0.0,
                       alarm=None) -> np.ndarray:
        values = np.ascontiguousarray(values, dtype=np.int64)
        out = np.empty((self.size, values.size), dtype=np.int64)
        self._kept_ints = (values, out)
        self._waiter.wait(self.comm.Iallgather(values, out), timeout_s, "allgather", alarm)
        return out

    def alltoall_ints(self, values: np.ndarray) -> np.ndarray:
        values = np.ascontiguousarray(values, dtype=np.int64)
        out = np.empty_like(values)
        self.comm.Alltoall(values, out)
        return out

    # -- data ------------------------------------------------------------------------------------
    def allreduce(self, buf: np.ndarray, op: int, send: np.ndarray | None = None,
                  prescale: float = 1.0, postscale: float = 1.0) -> None:
        """In place, or from ``send`` (same shape and dtype) into ``buf``; ``prescale`` is
        applied around the MPI call (into ``buf`` first when there is a ``send``),
        ``postscale`` after it."""
        if prescale != 1.0:
            scale_into(buf if send is None else send, prescale, buf)
            send = None
        self._mpi_allreduce(self.comm, buf, op, send)
        scale_inplace(buf, postscale)

    @staticmethod
    def _mpi_allreduce(comm: MPI.Comm, buf: np.ndarray, op: int,
                       send: np.ndarray | None = None) -> None:
        """``MPI_Allreduce`` over ``comm``, with what Open MPI does not do right by itself:
        16-bit float sums (the native op) and wrapping sums of 8- and 16-bit integers."""
        source = MPI.IN_PLACE if send is None else send.reshape(-1)
        if buf.dtype in HALF_DTYPES:
            comm.Allreduce(source if send is None else _halves(send), _halves(buf),
                           op=_half_sum(buf.dtype, op))
            return
        if _wraps_badly(buf.dtype, op):
            wide = (buf if send is None else send).astype(np.int64)
            comm.Allreduce(MPI.IN_PLACE, wide.reshape(-1), op=_OPS[op])
            buf[...] = wide.astype(buf.dtype)  # modulo 2**bits, as the narrow sum would
            return
        mpi_op = _BOOL_OPS[op] if buf.dtype == np.bool_ else _OPS[op]
        comm.Allreduce(source, buf.reshape(-1), op=mpi_op)

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
        if _wraps_badly(send.dtype, op):
            wide = np.empty(recv.size, np.int64)
            self.comm.Reduce_scatter(send.astype(np.int64).reshape(-1), wide, list(counts),
                                     op=_OPS[op])
            recv.reshape(-1)[...] = wide.astype(recv.dtype)
            return
        mpi_op = _BOOL_OPS[op] if send.dtype == np.bool_ else _OPS[op]
        self.comm.Reduce_scatter(send.reshape(-1), recv.reshape(-1), list(counts), op=mpi_op)

    def barrier(self) -> None:
        self.comm.Barrier()

    # -- process sets ----------------------------------------------------------------------------
    def sub(self, ranks) -> MpiBackend | None:
        """Collective over this communicator: a backend for ``ranks`` (None on non-members)."""
        comm = sub_communicator(self.comm, ranks)
        return None if comm is None else MpiBackend(comm)

    def free(self) -> None:
        """Release the communicator (local)."""
        free_communicator(self.comm)


def sub_communicator(comm: MPI.Comm, ranks) -> MPI.Comm | None:
    """Collective over ``comm``: a communicator of ``ranks`` (None on non-members)."""
    group = comm.Get_group().Incl(list(ranks))
    sub = comm.Create_group(group)
    group.Free()
    return None if sub == MPI.COMM_NULL else sub


def free_communicator(comm: MPI.Comm) -> None:
    """Release ``comm`` (local); the world and the null communicator are not ours to free."""
    if comm not in (MPI.COMM_WORLD, MPI.COMM_NULL):
        comm.Free()
