"""mpi4py backend: host buffers over MPI.

The negotiation collective is non-blocking and polled with a short back-off (:mod:`.waiting`).

When every rank of the communicator is on one node, the ranks share a window of memory
(:mod:`.shm`). Float sums of fused groups, and of tensors alone up to 8 MiB, go through it
natively, each rank copying in and out only what the others sum
(:meth:`MpiBackend.sum_in_window`); larger float tensors are summed through the ranks' own
memory (:mod:`.peer`, :meth:`MpiBackend.reduce_through_peers`); other fused groups are packed
straight into the window (:meth:`MpiBackend.staging`) and read straight out of it. All of them
save the copies MPI would add (``fusion.node_sum`` chooses).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..common.types import HALF_DTYPES, OP_NAMES, Max, Min, Product, Sum
from .peer import DTYPES as NATIVE_SUM_DTYPES
from .peer import PeerAllreduce
from .shm import NodeAllreduce, capacity_for
from .waiting import RequestWaiter

try:
    from .. import _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _native = None

_OPS = {Sum: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}
_BOOL_OPS = {Min: MPI.LAND, Max: MPI.LOR}


#: Open MPI 4.1's AVX reductions (its ``op/avx`` component, on by default) saturate sums of 8-
#: and 16-bit integers of 16 elements or more instead of wrapping (open-mpi/ompi#8045, left
#: as is on 4.1.x), so 200 + 200 gives 255 in uint8 there and 144 for fewer elements, in numpy,
#: torch and the node's shared window. These travel widened to 64 bits and wrap when narrowed
#: back; turning the component off instead would slow every float reduction down (1.3-4x here).
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


class MpiBackend:
    name = "mpi"

    def __init__(self, comm: MPI.Comm, shared_memory: bool = True):
        """Collective over ``comm``. ``shared_memory=False`` keeps every allreduce in MPI."""
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._waiter = RequestWaiter(self.size)
        self._timeout_s = 0.0  # the engine's peer timeout, as given to negotiate
        #: bytes of the largest fused group the shared window takes; None: no window
        self.fusion_capacity: int | None = None
        self._node: NodeAllreduce | None = None  # created on first use (collective)
        self._peer: PeerAllreduce | None = None  # likewise
        self._peer_refused = False
        self._native_window = False  # every rank sums natively in the window
        #: the window's native side once it exists and every rank sums natively in it (the
        #: engine hands it whole groups of requests, see Engine._execute); None otherwise
        self.window = None
        self.shared_memory = shared_memory
        if shared_memory and self.size > 1:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED)
            capacity = capacity_for(self.size)
            usable = (node.Get_size() == self.size
                      and NodeAllreduce.fits_on_node(capacity, self.size))
            node.Free()
            # /dev/shm may look different to a peer, and a peer may lack the extension
            answers = comm.allgather((usable, _native is not None))
            if all(usable for usable, _ in answers):
                self.fusion_capacity = capacity
                self._native_window = all(native for _, native in answers)

    # -- negotiation ---------------------------------------------------------------------------
    def negotiate(self, words: np.ndarray, timeout_s: float) -> None:
        """In-place bitwise AND of ``words`` over the set; raise if peers never arrive."""
        self._timeout_s = timeout_s
        req = self.comm.Iallreduce(MPI.IN_PLACE, words, op=MPI.BAND)
        self._waiter.wait(req, timeout_s, "negotiation")

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
    def staging(self, count: int, dtype: np.dtype) -> np.ndarray | None:
        """Where to pack a fused group of ``count`` elements of ``dtype`` for
        :meth:`reduce_staged`: this rank's part of the node's shared window. None when there
        is no window or the group does not fit: pack into a buffer of your own and call
        :meth:`allreduce`."""
        if self.fusion_capacity is None or count * dtype.itemsize > self.fusion_capacity:
            return None
        return self._window().stage(count, dtype)

    def _window(self) -> NodeAllreduce:
        if self._node is None:  # every rank gets here at the same agreed allreduce
            self._node = NodeAllreduce(self.comm, self.fusion_capacity, self._waiter)
            if self._native_window:
                self.window = self._node.native
        return self._node

    def sums_in_window(self, dtype: np.dtype) -> bool:
        """Whether fused sums of ``dtype`` can go through :meth:`sum_in_window`: the ranks
        share a window and every one of them has the native kernel for ``dtype``. Local, and
        the same on every rank."""
        return (self._native_window and self.fusion_capacity is not None
                and dtype.name in NATIVE_SUM_DTYPES)

    def sum_in_window(self, inputs: list[np.ndarray], outputs: list[np.ndarray],
                      dtype: np.dtype, factor: float) -> None:
        """``outputs[i] = factor x sum of every rank's inputs[i]``, through the shared window
        (:meth:`.shm.NodeAllreduce.reduce_arrays`), once :meth:`sums_in_window` said yes for
        ``dtype``; the group fits ``fusion_capacity``. Waits for peers as long as a
        negotiation would."""
        self._window().reduce_arrays(inputs, outputs, dtype, factor, self._timeout_s)

    def reduces_through_peers(self, dtype: np.dtype) -> bool:
        """Whether float sums of ``dtype`` can go through the other ranks' memory
        (:meth:`reduce_through_peers`). The answer is the same on every rank: False with ranks
        on several nodes, shared memory off, a dtype the native kernel does not sum, or
        cross-memory attach refused. Collective the first time it can be True."""
        if (self.fusion_capacity is None or dtype.name not in NATIVE_SUM_DTYPES
                or self._peer_refused):
            return False
        if self._peer is None:  # every rank gets here at the same agreed allreduce
            self._peer = PeerAllreduce.open(self.comm, self._waiter)
            self._peer_refused = self._peer is None
        return self._peer is not None

    def reduce_through_peers(self, inputs: list[np.ndarray], outputs: list[np.ndarray],
                             dtype: np.dtype, factor: float) -> None:
        """``outputs[i] = factor x sum of every rank's inputs[i]``, once
        :meth:`reduces_through_peers` said yes for ``dtype``. Waits for peers as long as a
        negotiation would."""
        self._peer.allreduce(inputs, outputs, dtype, factor, self._timeout_s)

    def reduce_staged(self, staged: np.ndarray, op: int) -> np.ndarray:
        """Reduce what every rank packed into :meth:`staging`'s buffer; returns the shared,
        read-only result, valid until the next call's result is read. Waits for peers as long
        as a negotiation would."""
        return self._node.reduce(staged, op, self._timeout_s)

    def allreduce(self, buf: np.ndarray, op: int) -> None:
        """In place, through MPI whatever the window: for one contiguous buffer MPI's
        single-copy transfers between processes beat copying it in and out of the window."""
        if buf.dtype in HALF_DTYPES:
            self.comm.Allreduce(MPI.IN_PLACE, _halves(buf), op=_half_sum(buf.dtype, op))
            return
        if _wraps_badly(buf.dtype, op):
            wide = buf.astype(np.int64)
            self.comm.Allreduce(MPI.IN_PLACE, wide.reshape(-1), op=_OPS[op])
            buf[...] = wide.astype(buf.dtype)  # modulo 2**bits, as the narrow sum would
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
        group = self.comm.Get_group().Incl(list(ranks))
        comm = self.comm.Create_group(group)
        group.Free()
        if comm == MPI.COMM_NULL:
            return None
        return MpiBackend(comm, shared_memory=self.shared_memory)

    def release_shared_memory(self) -> None:
        """Collective: free the shared window; later allreduces go through MPI. Called in the
        cycle where every rank agrees to stop, or when a process set is removed: freeing
        waits for every rank, so it is never done where a peer may not come (see ``free``)."""
        node, self._node, self.fusion_capacity = self._node, None, None
        self._peer = self.window = None
        if node is not None:
            node.free()

    def free(self) -> None:
        """Release the communicator. Local: a shared window not released by then (the job
        failed) is left to the end of the process."""
        self._node = self._peer = self.window = None
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_NULL):
            self.comm.Free()


def library_version() -> str:
    return MPI.Get_library_version().strip().splitlines()[0]
