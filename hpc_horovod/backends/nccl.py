"""NCCL backend (``cupy.cuda.nccl``): device buffers on a dedicated CUDA stream.

:class:`NcclBackend` moves device (cupy) buffers over an NCCL communicator, and nothing else:
host buffers, the negotiation and the other host collectives belong to the host backend, which
:class:`~hpc_horovod.backends.routed.RoutedBackend` pairs it with; called on it, they raise "nccl
does not support <op>". It keeps an MPI communicator of its own (``comm``) only to broadcast
the NCCL id and to split the node levels' communicators (hierarchical allreduce, GPU Adasum).
The NCCL communicator is created at the first device collective from a unique id made on rank 0
and broadcast over MPI; the engine reaches that point in the same order on every rank, as
ncclCommInitRank requires. Allreduce is one flat NCCL call across nodes unless the hierarchy
was asked for (:class:`NcclBackend`).

Ordering: all device work runs on the device's non-blocking stream
(:class:`~hpc_horovod.common.gpu_stream.DeviceStream`, one per GPU and process). The binding
records an event on the producer's stream when it submits a tensor, the engine makes the stream
wait for it (:meth:`NcclBackend.wait_for`), and after the collective the consumer's stream waits for
:meth:`NcclBackend.done_event`: no host or device-wide synchronization.

Failures: a collective whose peer died never ends on the device, and nothing on the host waits
for it. So the negotiation asks NCCL for asynchronous errors before it starts and while it waits
for peers (:meth:`NcclBackend.check_async_error`, polled by ``RoutedBackend.negotiate``), and
the engine, once it stops on an error, aborts every
NCCL communicator (:meth:`NcclBackend.abort`), which ends their kernels: the training thread's
next CUDA synchronization returns and its next op raises the engine's error.

The module imports without CuPy; only :class:`NcclBackend` needs it.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ..common.errors import HorovodInternalError
from ..common.gpu_probe import cuda_runtime_version, nccl_package
from ..common.gpu_stream import (
    DeviceStream,
    array_module,
    device_stream,
    on_device,
    pin_thread,
)
from ..common.types import HALF_DTYPES, OP_NAMES, Max, Min, Product, Sum, bfloat16
from .base import Backend
from .mpi import MpiBackend, _wraps_badly, free_communicator, sub_communicator

log = logging.getLogger("hpc_horovod")

NCCL_UNIQUE_ID_BYTES = 128
#: How long :meth:`NcclBackend.free_device` waits for the stream before aborting NCCL.
DRAIN_TIMEOUT_S = 60.0
_UNSIGNED_CHAR_MACHINES = ("aarch64", "arm64", "ppc64le", "ppc64", "s390x")


# -- unique id -------------------------------------------------------------------------------------
def serialize_unique_id(unique_id: bytes | Sequence[int]) -> bytes:
    """The 128 bytes of an ncclUniqueId, from CuPy 14's bytes or older CuPy's tuple of C chars
    (signed on x86, unsigned on ARM)."""
    if isinstance(unique_id, (bytes, bytearray)):
        data = bytes(unique_id)
    else:
        data = bytes(int(v) & 0xFF for v in unique_id)
    if len(data) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(data)}")
    return data


def unique_id_form(cupy_version: str, machine: str) -> str:
    """What this CuPy's NcclCommunicator takes: "bytes" (CuPy >= 14), else a tuple of C chars,
    "signed" or "unsigned" as the platform's ``char``."""
    if int(cupy_version.split(".")[0]) >= 14:
        return "bytes"
    machine = machine.lower()
    unsigned = machine.startswith("arm") or machine in _UNSIGNED_CHAR_MACHINES
    return "unsigned" if unsigned else "signed"


def deserialize_unique_id(data: bytes, form: str) -> bytes | tuple[int, ...]:
    """Turn :func:`serialize_unique_id`'s bytes into the ``form`` of :func:`unique_id_form`."""
    data = serialize_unique_id(data)
    if form == "bytes":
        return data
    if form == "unsigned":
        return tuple(data)
    if form == "signed":
        return tuple(b - 256 if b > 127 else b for b in data)
    raise ValueError(f"unknown unique id form {form!r}: use 'bytes', 'signed' or 'unsigned'")


# -- errors ----------------------------------------------------------------------------------------
_NETWORK_HINT = ("If ranks on different nodes cannot connect, set NCCL_SOCKET_IFNAME to the "
                 "interface the nodes reach each other on (e.g. ib0 or eth0, see `ip addr`), "
                 "and NCCL_IB_DISABLE=1 when InfiniBand is absent or misconfigured.")
_HINTS = {
    # ncclUnhandledCudaError
    1: ("A CUDA call inside NCCL failed: most often the GPU ran out of memory, or the CUDA "
        "driver is older than the CUDA that CuPy and NCCL were built for (compare "
        "`nvidia-smi` with the cupy-cuda12x/13x and nvidia-nccl-cu12/cu13 packages)."),
    # ncclSystemError
    2: ("A system call inside NCCL failed (sockets, shared memory, /dev/shm too small in a "
        "container). " + _NETWORK_HINT),
    # ncclInvalidArgument
    4: "The ranks called NCCL with invalid arguments: a bug, please report it.",
    # ncclInvalidUsage
    5: ("NCCL refused how it is used: most often two ranks use one GPU (NCCL 2.30 and newer: "
        "\"Multiple Ranks are using the same GPU/Partition\"; older: \"Duplicate GPU "
        "detected\"). Give each rank its own: one rank per GPU (`--ntasks-per-node` = GPUs per "
        "node, or `srun --gpus-per-task=1`), a different CUDA_VISIBLE_DEVICES per rank when a "
        "launcher sets it, or NCCL 2.30+ with NCCL_MULTI_RANK_GPU_ENABLE=1. Otherwise the ranks "
        "called NCCL in different orders: a bug, please report it."),
    # ncclRemoteError
    6: "A peer rank failed or a network link went down. " + _NETWORK_HINT,
}


def nccl_error(exc: BaseException, activity: str) -> HorovodInternalError:
    """The HorovodInternalError for an NCCL failure (``cupy.cuda.nccl.NcclError``), with the
    usual fixes for its status (ncclResult_t)."""
    hint = _HINTS.get(getattr(exc, "status", None), _NETWORK_HINT)
    return HorovodInternalError(f"NCCL {activity} failed: {exc}. {hint} Rerun with "
                                "NCCL_DEBUG=INFO (and NCCL_DEBUG_SUBSYS=INIT,NET) to see why.")


@contextlib.contextmanager
def _nccl_errors(nccl, activity: str):
    try:
        yield
    except nccl.NcclError as exc:
        raise nccl_error(exc, activity) from exc


@contextlib.contextmanager
def _group(nccl):
    """ncclGroupStart/End: the calls inside launch together (p2p pairs cannot deadlock)."""
    nccl.groupStart()
    try:
        yield
    finally:
        nccl.groupEnd()


# -- pure plans ------------------------------------------------------------------------------------
class ReductionPlan(NamedTuple):
    nccl_type: str
    nccl_op: str
    #: dtype to widen to first (NCCL has no 16-bit integers), or None
    stage: np.dtype | None


_NCCL_TYPES = {np.dtype(k): v for k, v in (
    (np.int8, "NCCL_INT8"), (np.uint8, "NCCL_UINT8"), (np.int32, "NCCL_INT32"),
    (np.uint32, "NCCL_UINT32"), (np.int64, "NCCL_INT64"), (np.uint64, "NCCL_UINT64"),
    (np.float16, "NCCL_FLOAT16"), (bfloat16, "NCCL_BFLOAT16"), (np.float32, "NCCL_FLOAT32"),
    (np.float64, "NCCL_FLOAT64"), (np.bool_, "NCCL_UINT8"))}
# Widening is exact: sums and products wrap the same way modulo 2**16 in 32 bits.
_STAGED = {np.dtype(np.int16): np.dtype(np.int32), np.dtype(np.uint16): np.dtype(np.int32)}
_NCCL_OPS = {Sum: "NCCL_SUM", Product: "NCCL_PROD", Min: "NCCL_MIN", Max: "NCCL_MAX"}


def reduction_plan(dtype, op: int) -> ReductionPlan:
    """How NCCL reduces ``dtype`` with ``op``. Average arrives as Sum (the engine scales)."""
    dtype = np.dtype(dtype)
    if op not in _NCCL_OPS:
        raise ValueError(f"NCCL reduces with Sum, Product, Min or Max, not "
                         f"{OP_NAMES.get(op, op)}: the engine turns Average into Sum plus "
                         "scaling and runs Adasum itself")
    if dtype == np.bool_ and op not in (Min, Max):
        raise ValueError("bool tensors reduce only with Min (logical and) or Max (logical or)")
    if dtype in _STAGED:
        return ReductionPlan(_NCCL_TYPES[_STAGED[dtype]], _NCCL_OPS[op], _STAGED[dtype])
    if dtype not in _NCCL_TYPES:
        names = ", ".join(sorted({str(d) for d in (*_NCCL_TYPES, *_STAGED)}))
        raise TypeError(f"NCCL cannot reduce {dtype} tensors; supported: {names}")
    return ReductionPlan(_NCCL_TYPES[dtype], _NCCL_OPS[op], None)


def offsets(counts: Sequence[int]) -> list[int]:
    """Start of each rank's segment in a buffer of segments laid end to end."""
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += int(count)
    return starts


def segments(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """(rank, offset, count) of every non-empty segment: one rooted NCCL call each."""
    return [(r, off, int(c)) for r, (off, c) in enumerate(zip(offsets(counts), counts)) if c]


def p2p_plan(send_counts: Sequence[int], recv_counts: Sequence[int]
             ) -> list[tuple[str, int, int, int]]:
    """("send"|"recv", peer, offset, count) for an alltoallv. Empty transfers are skipped on
    both sides alike, since this rank's send count to j is j's receive count from it."""
    plan = []
    for peer, (s_off, s, r_off, r) in enumerate(zip(offsets(send_counts), send_counts,
                                                    offsets(recv_counts), recv_counts)):
        if s:
            plan.append(("send", peer, s_off, int(s)))
        if r:
            plan.append(("recv", peer, r_off, int(r)))
    return plan


class FusionBuffers:
    """One reusable buffer per dtype, grown on demand. A returned view is valid until the next
    ``get`` for that dtype: results must be copied out of it (stream order makes that safe)."""

    def __init__(self, allocate: Callable[[int, np.dtype], object]):
        self._allocate = allocate
        self._buffers: dict[np.dtype, object] = {}

    def get(self, dtype, count: int):
        dtype = np.dtype(dtype)
        buf = self._buffers.get(dtype)
        if buf is None or buf.size < count:
            self._buffers.pop(dtype, None)  # free the old one before allocating the larger
            buf = self._buffers[dtype] = self._allocate(count, dtype)
        return buf[:count]

    def clear(self) -> None:
        self._buffers.clear()


# -- hierarchical allreduce ------------------------------------------------------------------------
def node_comms(comm, node_id: int):
    """(local, cross) mpi4py communicators: the ranks of this node, and the ranks with this
    local rank on every node. None (after freeing them) when nodes hold different numbers of
    ranks, where a shard per local rank cannot line up across nodes. Collective over ``comm``."""
    local = comm.Split(color=int(node_id), key=comm.Get_rank())
    cross = comm.Split(color=local.Get_rank(), key=comm.Get_rank())
    if len(set(comm.allgather(local.Get_size()))) != 1:
        local.Free()
        cross.Free()
        return None
    return local, cross


def mpi_wire_dtype(dtype, op: int) -> np.dtype:
    """The dtype a shard crosses nodes in over MPI: float32 for half floats (MPI reduces no
    16-bit float without the native extension; the extra precision is rounded away on the way
    back), int64 for the 8/16-bit integer sums and products that Open MPI's vector reductions
    saturate instead of wrapping (see ``backends/mpi.py``), else its own."""
    dtype = np.dtype(dtype)
    if dtype in HALF_DTYPES:
        return np.dtype(np.float32)
    if _wraps_badly(dtype, op):
        return np.dtype(np.int64)
    return dtype


class CrossAllreduce:
    """Allreduce of one shard across nodes over MPI, through a pinned host buffer for a device
    shard. The shard is widened first (:func:`mpi_wire_dtype`), on the stream; the copy to the
    host waits for the stream, so MPI, which knows no streams, reads finished data."""

    def __init__(self, cross: MpiBackend, stream=None):
        self.cross = cross
        self.stream = stream
        self._host = FusionBuffers(self._pinned)

    @staticmethod
    def _pinned(count: int, dtype: np.dtype):
        import cupyx

        return cupyx.empty_pinned(count, dtype)

    def __call__(self, shard, op: int) -> None:
        wire = mpi_wire_dtype(shard.dtype, op)
        wide = shard.astype(wire) if wire != shard.dtype else shard
        if self.stream is None:  # host memory
            self.cross.allreduce(wide, op)
        else:
            host = self._host.get(wide.dtype, wide.size)
            wide.get(stream=self.stream, out=host)  # blocking: waits for the stream
            self.cross.allreduce(host, op)
            wide.set(host, stream=self.stream)
        if wide is not shard:
            array_module(shard).copyto(shard, wide, casting="unsafe")


class HierarchicalAllreduce:
    """HOROVOD_HIERARCHICAL_ALLREDUCE: reduce-scatter inside the node, allreduce of each shard
    across nodes, allgather inside the node. Only 1/local_size of the data crosses the slower
    inter-node network, from every GPU at once.

    ``local`` is a backend over the node's ranks (NCCL for device buffers; any backend with
    ``reduce_scatter`` and ``allgatherv``), ``cross_allreduce`` reduces a shard across nodes.
    """

    def __init__(self, local, cross_allreduce: Callable[[object, int], None]):
        self.local = local
        self.cross_allreduce = cross_allreduce

    def __call__(self, buf, op: int) -> None:
        flat = buf.reshape(-1)
        n = flat.size
        if n == 0:
            return
        xp = array_module(flat)
        parts = self.local.size
        shard = -(-n // parts)
        if shard * parts == n:
            work = flat
        else:  # pad so that every local rank owns an equal shard; padding is dropped after
            work = xp.empty(shard * parts, dtype=flat.dtype)
            work[:n] = flat
            work[n:] = 0
        mine = xp.empty(shard, dtype=flat.dtype)
        self.local.reduce_scatter(work, mine, [shard] * parts, op)
        self.cross_allreduce(mine, op)
        self.local.allgatherv(mine, work, [shard] * parts)
        if work is not flat:
            flat[...] = work[:n]


def _ptr(array) -> int:
    return array.data.ptr


def release_framework_cache() -> None:
    """Give the framework's cached, unused device blocks back to the driver (torch's caching
    allocator: ``torch.cuda.empty_cache``), so that NCCL finds memory for a new communicator."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# -- the backend -----------------------------------------------------------------------------------
class NcclBackend(Backend):
    """A process set's device backend: NCCL for device buffers, over the ranks of ``comm`` (an
    mpi4py communicator this backend owns, used only to set NCCL up). The host-only methods
    are :class:`~hpc_horovod.backends.base.Backend`'s refusals.

    Allreduce is one flat NCCL call over every rank of the set, across nodes too: NCCL's own
    inter-node algorithms (ring and tree over the network, GPUDirect RDMA) carry it.
    ``node_id`` (this rank's node index, the topology's) gives the node levels that Adasum uses
    (:meth:`node_levels`); ``hierarchical`` (asked for explicitly, see
    ``backends._nccl_backend``) turns allreduce into NCCL inside the node and MPI across nodes
    through host memory, where the set spans several nodes with the same number of ranks each.
    """

    name = "nccl"

    def __init__(self, comm, device: int, *, node_id: int | None = None,
                 hierarchical: bool = False):
        import cupy
        from cupy.cuda import nccl

        if not getattr(nccl, "available", False):
            raise RuntimeError("CuPy was built without NCCL or cannot load it: `pip install "
                               f"{nccl_package(cuda_runtime_version())}` (or load the "
                               "cluster's NCCL)")
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._cupy, self._nccl = cupy, nccl
        self.device = int(device)
        self.node_id = node_id
        self.hierarchical = hierarchical
        # Nothing touches the device here (init runs on the caller's thread, which may have no
        # context on it yet): the stream, the communicator and the buffers come with the first
        # device collective, on the thread that runs it, pinned to the device.
        self._device: DeviceStream = device_stream(self.device)
        self.fusion = FusionBuffers(self._allocate)
        self._nccl_comm = None
        #: (node backend, cross-node MPI backend), False where there are none; None: not known
        self._levels: tuple[NcclBackend, MpiBackend] | bool | None = None
        self._hierarchy: HierarchicalAllreduce | None = None

    # -- stream and memory -------------------------------------------------------------------------
    @property
    def stream(self):
        """The device's stream that every device collective of this process runs on."""
        return self._device.stream

    def activate(self):
        """This backend's device and stream as current: cupy work inside (packing the fusion
        buffer, scaling, unpacking) is ordered with the collectives."""
        return self._device.activate()

    def _allocate(self, count: int, dtype: np.dtype):
        with self.activate():
            return self._cupy.empty(count, dtype=dtype)

    def fusion_buffer(self, dtype, count: int):
        """A device buffer of ``count`` elements, reused for every fused group of ``dtype``."""
        return self.fusion.get(dtype, count)

    def wait_for(self, event) -> None:
        """Order this backend's stream after ``event``, recorded on a producer's stream."""
        self._device.wait_for(event)

    def done_event(self):
        """An event the consumer's stream waits on to see the results."""
        return self._device.done_event()

    # -- communicators -----------------------------------------------------------------------------
    def _communicator(self):
        if self._nccl_comm is None:
            self._nccl_comm = self._create_communicator()
        return self._nccl_comm

    def _create_communicator(self):
        """ncclCommInitRank over this set: rank 0 makes the id, MPI carries it (or rank 0's
        failure, so that no rank waits for an id that never comes).

        A communicator may be created late, at a process set's first device collective inside
        the backward pass, when the framework's caching allocator holds most of the GPU:
        NCCL's own buffers then fail to allocate (ncclUnhandledCudaError). The framework's
        cached, unused blocks are therefore released first (:func:`release_framework_cache`),
        on every rank alike. A retry after a failure could not be made collective: a rank
        whose init failed leaves its peers inside theirs."""
        nccl = self._nccl
        payload = None
        if self.rank == 0:
            try:
                payload = ("id", serialize_unique_id(nccl.get_unique_id()))
            except Exception as exc:  # any failure must reach the ranks waiting in bcast
                payload = ("error", str(nccl_error(exc, "ncclGetUniqueId")))
        kind, data = self.comm.bcast(payload, root=0)
        if kind == "error":
            raise HorovodInternalError(f"rank 0: {data}")
        unique_id = deserialize_unique_id(
            data, unique_id_form(self._cupy.__version__, platform.machine()))
        pin_thread(self.device)
        release_framework_cache()
        with _nccl_errors(nccl, "ncclCommInitRank"):
            return nccl.NcclCommunicator(self.size, unique_id, self.rank)

    def node_levels(self) -> tuple[NcclBackend, MpiBackend] | None:
        """(node, cross): an NCCL backend over this rank's node and an MPI backend over the
        ranks with its local rank on every node; None when the set lies on one node, when
        nodes hold different numbers of ranks (shards cannot line up) or when the node is
        unknown. Collective over the set at the first call (the engine makes it in the same
        order on every rank)."""
        if self._levels is None:
            self._levels = False
            comms = node_comms(self.comm, self.node_id) if self.node_id is not None else None
            if comms is not None:
                local, cross = comms
                if cross.Get_size() == 1:  # one node: nothing crosses nodes
                    local.Free()
                    cross.Free()
                else:
                    self._levels = (NcclBackend(local, self.device), MpiBackend(cross))
        return self._levels or None

    def _hierarchical(self) -> HierarchicalAllreduce | None:
        if not self.hierarchical:
            return None
        if self._hierarchy is None:
            levels = self.node_levels()
            if levels is None:
                if self.rank == 0:
                    log.warning("hierarchical allreduce needs several nodes with the same "
                                "number of ranks each; using the flat NCCL allreduce")
                self.hierarchical = False
                return None
            local, cross = levels
            self._hierarchy = HierarchicalAllreduce(local, CrossAllreduce(cross, self.stream))
        return self._hierarchy

    def _const(self, name: str) -> int:
        """An NCCL datatype or operation constant by name (``NCCL_FLOAT32``, ``NCCL_SUM``)."""
        return getattr(self._nccl, name)

    # -- device data -------------------------------------------------------------------------------
    def _device_arrays(self, *arrays) -> None:
        """Refuse host buffers (the host backend moves them) and non-contiguous ones."""
        for array in arrays:
            if isinstance(array, np.ndarray):
                self._unsupported("host buffers (numpy arrays)")
            if not array.flags.c_contiguous:
                raise ValueError("NCCL collectives need C-contiguous device buffers")

    def allreduce(self, buf, op: int, send=None, prescale: float = 1.0,
                  postscale: float = 1.0) -> None:
        """Reduction of ``buf`` over the set, in place, or from ``send`` (same shape and dtype)
        into ``buf``: NCCL reads one buffer and writes the other, with no copy of ours. The
        engine scales device buffers itself, on the stream: scale factors are refused."""
        if prescale != 1.0 or postscale != 1.0:
            self._unsupported("allreduce with scale factors (scale on the device)")
        source = buf if send is None else send
        self._device_arrays(buf, source)
        plan = reduction_plan(buf.dtype, op)
        if buf.size == 0:
            return None
        with self.activate():
            if plan.stage is not None:
                wide = source.astype(plan.stage)
                self.allreduce(wide, op)
                self._cupy.copyto(buf, wide, casting="unsafe")
                return None
            hierarchy = self._hierarchical()
            if hierarchy is not None:
                if source is not buf:
                    buf[...] = source
                hierarchy(buf, op)
                return None
            comm = self._communicator()
            with _nccl_errors(self._nccl, "allreduce"):
                comm.allReduce(_ptr(source), _ptr(buf), buf.size,
                               self._const(plan.nccl_type), self._const(plan.nccl_op),
                               self.stream.ptr)
        return None

    def allgatherv(self, send, recv, counts) -> None:
        """Rank r's ``counts[r]`` elements, laid end to end in ``recv`` on every rank."""
        self._device_arrays(send, recv)
        counts = [int(c) for c in counts]
        item = send.dtype.itemsize
        int8 = self._const("NCCL_INT8")
        with self.activate():
            comm = self._communicator()
            stream = self.stream.ptr
            with _nccl_errors(self._nccl, "allgather"):
                if len(set(counts)) == 1:
                    if counts[0]:
                        comm.allGather(_ptr(send), _ptr(recv), counts[0] * item, int8, stream)
                    return None
                with _group(self._nccl):  # uneven: one broadcast per rank, launched together
                    for root, off, count in segments(counts):
                        dst = _ptr(recv) + off * item
                        src = _ptr(send) if root == self.rank else dst
                        comm.broadcast(src, dst, count * item, int8, root, stream)
        return None

    def bcast(self, buf, root: int) -> None:
        """Rank ``root``'s ``buf`` on every rank, in place."""
        self._device_arrays(buf)
        if buf.nbytes == 0:
            return None
        with self.activate():
            comm = self._communicator()
            with _nccl_errors(self._nccl, "broadcast"):
                comm.broadcast(_ptr(buf), _ptr(buf), buf.nbytes, self._const("NCCL_INT8"),
                               root, self.stream.ptr)
        return None

    def alltoallv(self, send, send_counts, recv, recv_counts) -> None:
        """Rank i sends ``send_counts[j]`` elements to rank j, grouped send/recv pairs."""
        self._device_arrays(send, recv)
        item = send.dtype.itemsize
        int8 = self._const("NCCL_INT8")
        with self.activate():
            comm = self._communicator()
            stream = self.stream.ptr
            with _nccl_errors(self._nccl, "alltoall"), _group(self._nccl):
                for kind, peer, off, count in p2p_plan(send_counts, recv_counts):
                    if kind == "send":
                        comm.send(_ptr(send) + off * item, count * item, int8, peer, stream)
                    else:
                        comm.recv(_ptr(recv) + off * item, count * item, int8, peer, stream)
        return None

    def reduce_scatter(self, send, recv, counts, op: int) -> None:
        """Reduce ``send`` over the set; this rank keeps its ``counts[rank]`` elements."""
        self._device_arrays(send, recv)
        counts = [int(c) for c in counts]
        plan = reduction_plan(send.dtype, op)
        with self.activate():
            if plan.stage is not None:
                wide = self._cupy.empty(recv.size, dtype=plan.stage)
                self.reduce_scatter(send.astype(plan.stage), wide, counts, op)
                self._cupy.copyto(recv, wide, casting="unsafe")
                return None
            comm = self._communicator()
            dtype, nccl_op = self._const(plan.nccl_type), self._const(plan.nccl_op)
            item, stream = send.dtype.itemsize, self.stream.ptr
            with _nccl_errors(self._nccl, "reducescatter"):
                if len(set(counts)) == 1:
                    if counts[0]:
                        comm.reduceScatter(_ptr(send), _ptr(recv), counts[0], dtype, nccl_op,
                                           stream)
                    return None
                with _group(self._nccl):  # uneven: one reduce per rank, launched together
                    for root, off, count in segments(counts):
                        comm.reduce(_ptr(send) + off * item, _ptr(recv), count, dtype, nccl_op,
                                    root, stream)
        return None

    # -- health and lifetime -----------------------------------------------------------------------
    def _node_backend(self) -> NcclBackend | None:
        return self._levels[0] if self._levels else None

    def check_async_error(self) -> None:
        """Raise HorovodInternalError, naming this rank, if NCCL saw an asynchronous failure on
        one of this set's communicators (a peer or a link lost); cheap to poll."""
        node = self._node_backend()
        if node is not None:
            node.check_async_error()
        if self._nccl_comm is not None:
            with _nccl_errors(self._nccl, f"communication on rank {self.rank}"):
                self._nccl_comm.check_async_error()

    def abort(self) -> None:
        """End this set's NCCL communicators at once (``ncclCommAbort``), the node-local one
        too: their kernels stop, so no stream and no thread waiting on one stays blocked
        behind a collective whose peer is gone. The fusion buffers go back to the framework's
        allocator (in the stream's order): an abandoned backend keeps no device memory. The
        engine calls it when it stops on an error; the MPI communicator stays for
        :meth:`free`."""
        node = self._node_backend()
        if node is not None:
            node.abort()
        self.fusion.clear()
        if self._nccl_comm is not None:
            comm, self._nccl_comm = self._nccl_comm, None
            log.warning("rank %d: aborting the NCCL communicator after an error", self.rank)
            try:
                comm.abort()
            except Exception as exc:  # noqa: BLE001 - the engine's own error is the one to see
                log.warning("rank %d: ncclCommAbort failed: %s", self.rank, exc)

    def sub(self, ranks) -> NcclBackend | None:
        """Collective over this set: a backend for ``ranks`` (None on non-members)."""
        comm = sub_communicator(self.comm, ranks)
        if comm is None:
            return None
        return NcclBackend(comm, self.device, node_id=self.node_id,
                           hierarchical=self.hierarchical)

    def free_device(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Destroy the NCCL communicators and drop the device buffers once the stream has
        drained; the MPI communicator stays (:meth:`free` releases it). When the stream does
        not drain (a peer died inside a collective, NCCL reports an asynchronous error, or
        ``timeout_s`` passes) the communicators are aborted instead, which ends their kernels:
        neither this call nor the framework's later waits on the stream hang."""
        drained = self._drain(timeout_s)
        if self._levels:
            node, cross = self._levels
            node.free_device(timeout_s if drained else 0.0)
            free_communicator(node.comm)
            cross.free()
        self._levels = self._hierarchy = None
        if self._nccl_comm is not None:
            comm, self._nccl_comm = self._nccl_comm, None
            if drained:
                comm.destroy()
            else:
                log.warning("NCCL work did not finish (rank %d): aborting the communicator",
                            self.rank)
                comm.abort()
        self.fusion.clear()

    def _drain(self, timeout_s: float) -> bool:
        """Wait for the stream to finish; False when it did not (see :meth:`free_device`)."""
        if self._device._stream is None:  # no device work ever ran
            return True
        deadline = time.monotonic() + timeout_s
        with on_device(self.device):  # this thread may not have run any device work yet
            while not self.stream.done:
                try:
                    self.check_async_error()
                except HorovodInternalError as exc:
                    log.warning("%s", exc)
                    return False
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.001)
        return True

    def free(self) -> None:
        """Everything :meth:`free_device` frees, and the MPI communicator."""
        self.free_device()
        free_communicator(self.comm)
