"""Allreduce through memory shared by the ranks of one node.

Inside a node, MPI's allreduce copies the buffer into shared memory, reduces it there and copies
the result out, and the fusion buffer adds a copy of its own on each side. Here the ranks share
one MPI window, two ways:

* float sums, natively (:meth:`NodeAllreduce.reduce_arrays`, ``src_native/window.h``): each rank
  copies into its segment only the bytes the other ranks own, sums its own 1/n of the group
  straight from its tensors and the peers' segments into its outputs and the shared result,
  then copies out of the result only what the others summed. Its own slice is never copied.
* everything else (:meth:`NodeAllreduce.stage` and :meth:`NodeAllreduce.reduce`): the fusion
  buffer *is* this rank's segment, each rank reduces 1/n of it across every segment with numpy,
  and results are read straight from the shared result.

The native way goes in rounds, every rank's counters in the window saying how far it has
written and summed (``src_native/window.h``); the other orders its two phases, every segment
written then every slice reduced, with non-blocking barriers. Both give up after the engine's
peer timeout, so a peer that died mid-group is reported instead of waited for. Two slots
alternate, so a rank may fill the next buffer while a slower peer still reads the previous
result: no rank gets past the start of a reduction before every peer has finished reading the
one before, so a slot is never written while it is read.
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from ..common import patience
from ..common.errors import window_timeout
from ..common.types import HALF_DTYPES, OP_NAMES, Max, Min, Product, Sum
from .waiting import RequestWaiter

try:
    from .. import _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _native = None

_UFUNCS = {Sum: np.add, Min: np.minimum, Max: np.maximum, Product: np.multiply}
_BOOL_UFUNCS = {Min: np.logical_and, Max: np.logical_or}
_ALIGN = 64  # slice bounds on cache lines: no two ranks write one line of the result
_SLOTS = 2
#: the shared window stays under this, whatever the number of ranks on the node
WINDOW_BUDGET = 192 << 20


def capacity_for(local_size: int) -> int:
    """Bytes of one staging segment: 16 MiB with few ranks per node, less with many (down to
    1 MiB), so that the window (``2 x (ranks + 1)`` segments) stays near ``WINDOW_BUDGET``."""
    per = WINDOW_BUDGET // (_SLOTS * (local_size + 1))
    return max(1 << 20, min(16 << 20, per)) // _ALIGN * _ALIGN


def _slice_bounds(count: int, itemsize: int, n: int, r: int) -> tuple[int, int]:
    step = max(1, _ALIGN // itemsize)
    per = -(-count // (n * step)) * step
    lo = min(r * per, count)
    return lo, min(lo + per, count)


class NodeAllreduce:
    """Allreduce over ``comm``, whose ranks all share this node, through one shared window.

    Creating it is collective over ``comm`` (the window is allocated and every rank touches its
    own pages, which places them on its NUMA node).
    """

    def __init__(self, comm: MPI.Comm, capacity: int, waiter: RequestWaiter | None = None):
        self.comm = comm
        self._waiter = waiter or RequestWaiter(comm.Get_size())
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.capacity = capacity
        n = self.size
        slots = _SLOTS * (n + 1) * capacity
        total = slots + n * _ALIGN  # then the ranks' counters, a cache line each
        self.win = MPI.Win.Allocate_shared(total if self.rank == 0 else 0, 1, comm=comm)
        memory, _ = self.win.Shared_query(0)
        mem = np.frombuffer(memory, dtype=np.uint8, count=total)
        flags = mem[slots:].view(np.int64)
        # slot s: segments of ranks 0..n-1, then the result
        self._segments = [[mem[(s * (n + 1) + q) * capacity:][:capacity] for q in range(n)]
                          for s in range(_SLOTS)]
        self._results = [mem[(s * (n + 1) + n) * capacity:][:capacity] for s in range(_SLOTS)]
        self.win.Lock_all(MPI.MODE_NOCHECK)
        for s in range(_SLOTS):
            self._segments[s][self.rank][:] = 0
            lo, hi = _slice_bounds(capacity, 1, n, self.rank)
            self._results[s][lo:hi] = 0
        # this rank's counters (rounds written, rounds summed: window.h), before anyone reads them
        flags[self.rank * _ALIGN // 8:][:_ALIGN // 8] = 0
        #: the native side (``src_native/window_object.c``): the native sums, and the slot
        #: counter every reduction shares; None without the extension
        self.native = None if _native is None else _native.Window(mem[:slots], flags,
                                                                  self.rank, n, _SLOTS)
        self._slot = 0  # the slot counter without the extension
        self._staged: np.ndarray | None = None
        self._sync(0.0, "creating the shared window")

    @staticmethod
    def fits_on_node(capacity: int, local_size: int) -> bool:
        """Whether /dev/shm has room for the window twice over: a full tmpfs would let the
        allocation succeed and kill the job with SIGBUS when a page is first touched."""
        try:
            stat = os.statvfs("/dev/shm")
        except OSError:
            return True  # no /dev/shm: MPI puts the window elsewhere and reports its own errors
        return stat.f_bavail * stat.f_frsize >= 2 * _SLOTS * (local_size + 1) * capacity

    def _sync(self, timeout_s: float, what: str) -> None:
        """Every rank's writes to the window before this point are visible to every rank
        after it (MPI-3 unified model: ``Win_sync``, barrier, ``Win_sync``)."""
        self.win.Sync()
        self._waiter.wait(self.comm.Ibarrier(), timeout_s, what)
        self.win.Sync()

    def _take_slot(self) -> int:
        """The slot of the next reduction, whichever way it goes."""
        if self.native is not None:
            return self.native.take_slot()
        slot = self._slot
        self._slot = (slot + 1) % _SLOTS
        return slot

    def stage(self, count: int, dtype: np.dtype) -> np.ndarray:
        """This rank's input for the next reduction: ``count`` elements of ``dtype`` in the
        shared window, to be filled then passed to :meth:`reduce`."""
        if count * dtype.itemsize > self.capacity:
            raise ValueError(f"NodeAllreduce.stage: {count} x {dtype} is more than the "
                             f"{self.capacity} bytes of a segment")
        slot = self._take_slot()
        staged = self._segments[slot][self.rank][: count * dtype.itemsize].view(dtype)
        self._staged = staged, slot
        return staged

    def reduce(self, staged: np.ndarray, op: int, timeout_s: float = 0.0) -> np.ndarray:
        """Reduce every rank's staged input; returns the shared, read-only result, valid until
        the call after next. Raises HorovodInternalError when a peer does not come within
        ``timeout_s`` (0: wait for ever)."""
        if self._staged is None or staged is not self._staged[0]:
            raise RuntimeError("NodeAllreduce.reduce: the buffer was not the last one staged")
        slot, self._staged = self._staged[1], None
        dtype, count = staged.dtype, staged.size
        nbytes = count * dtype.itemsize
        inputs = [seg[:nbytes].view(dtype) for seg in self._segments[slot]]
        result = self._results[slot][:nbytes].view(dtype)
        what = f"shared-memory allreduce of {count} x {dtype}"
        self._sync(timeout_s, what)  # every input written
        lo, hi = _slice_bounds(count, dtype.itemsize, self.size, self.rank)
        if hi > lo:
            _reduce_into(result[lo:hi], [x[lo:hi] for x in inputs], op)
        self._sync(timeout_s, what)  # every slice reduced
        result.flags.writeable = False
        return result

    def reduce_arrays(self, inputs: list[np.ndarray], outputs: list[np.ndarray],
                      dtype: np.dtype, factor: float, timeout_s: float = 0.0) -> None:
        """``outputs[i] = factor x (sum over ranks of inputs[i])`` for every i, natively
        (float16, bfloat16, float32, float64; see ``src_native/window.h``): each rank copies
        into the window only what the others sum, and out of it only what they summed. The
        group must fit a segment; an output may be its input. Raises HorovodInternalError
        naming the ranks that did not come within ``timeout_s`` (0: wait for ever)."""
        table = np.empty((len(inputs), 3), dtype=np.uint64)
        _native.peer_table(inputs, outputs, table)
        try:
            self.native.sum(table, dtype.name, factor, timeout_s, patience.yield_s())
        except TimeoutError as exc:
            raise window_timeout(len(inputs), dtype, exc) from None

    def free(self) -> None:
        """Collective: release the window."""
        if self.native is not None:
            self.native.close()
        self.win.Unlock_all()
        self.win.Free()


def _reduce_into(out: np.ndarray, inputs: list[np.ndarray], op: int) -> None:
    """``out = inputs[0] op inputs[1] op ...``, in rank order, so every slice of the result is
    computed the same way whichever rank owns it."""
    if out.dtype in HALF_DTYPES:
        if op != Sum:
            raise ValueError(f"no {out.dtype} {OP_NAMES.get(op, op)}: reduce it in float32")
        # the engine stages half floats only when the extension is built
        _native.reduce_sum(inputs[0], inputs[1], out)
        for x in inputs[2:]:
            _native.reduce_sum(x, out)
        return
    ufunc = (_BOOL_UFUNCS if out.dtype == np.bool_ else _UFUNCS)[op]
    with np.errstate(all="ignore"):  # overflow to inf is the answer, as from MPI, not a warning
        ufunc(inputs[0], inputs[1], out=out)
        for x in inputs[2:]:
            ufunc(out, x, out=out)
