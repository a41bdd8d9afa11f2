"""What the engine asks of a backend: one communicator of one process set.

Every backend (``single``, ``mpi``, ``hierarchical`` for host buffers; ``nccl`` for device
buffers) subclasses :class:`Backend`, which names every method the engine, ``execution`` and
``collectives`` call. A method a backend does not override raises
``NotImplementedError("<backend> does not support <op>")``: an op is either complete in a
backend or refused by it, never half done. :func:`hpc_horovod.backends.compose` puts one host
backend and at most one device backend together and routes each call by where its buffer lives.

The engine calls these methods from whichever thread runs its cycles (one at a time), in the same
order on every member rank. Reductions receive arrays of a dtype the backend reduces (the engine
widens float16 and bfloat16 to float32 when no native sum exists); the data-movement methods take
any dtype.
"""

from __future__ import annotations

import numpy as np


class Backend:
    name: str = "backend"
    rank: int
    size: int
    #: the GPU whose device buffers this backend moves itself (NCCL); None for host backends
    device: int | None = None

    def _unsupported(self, op: str):
        raise NotImplementedError(f"{self.name} does not support {op}")

    # -- negotiation (host memory, small) --------------------------------------------------------
    def negotiate(self, words: np.ndarray, timeout_s: float, alarm=None) -> None:
        """In-place bitwise AND of ``words`` over the set; raise HorovodInternalError when a
        peer does not come within ``timeout_s`` (0: wait for ever), and ``alarm.error`` as soon
        as it is set while waiting."""
        self._unsupported("negotiate")

    def agree(self, obj, decide, timeout_s: float = 0.0, alarm=None):
        """``decide(objs)`` run on rank 0 over every rank's picklable ``obj`` (in rank order),
        its picklable result returned on every rank; ``timeout_s`` and ``alarm`` as in
        :meth:`negotiate`. One rank decides and the others receive its decision, so every
        rank acts on the same one, and no rank holds more than its own ``obj`` and the
        decision except rank 0 (Horovod's controller does the same)."""
        self._unsupported("agree")

    def allgather_ints(self, values: np.ndarray, timeout_s: float = 0.0,
                       alarm=None) -> np.ndarray:
        """(size, len(values)) int64: every rank's ``values``; ``timeout_s`` and ``alarm`` as
        in :meth:`negotiate`."""
        self._unsupported("allgather_ints")

    def node_levels(self):
        """(the backend of this rank's node, the backend across nodes among ranks of the same
        local rank) for Adasum on devices, or None where there are no such levels (host
        backends; one node; nodes of different sizes)."""
        return None

    def alltoall_ints(self, values: np.ndarray) -> np.ndarray:
        """int64 ``values[i]`` sent to rank i; returns what each rank sent to this one."""
        self._unsupported("alltoall_ints")

    # -- data ------------------------------------------------------------------------------------
    def allreduce(self, buf, op: int, send=None, prescale: float = 1.0,
                  postscale: float = 1.0) -> None:
        """Over every rank's ``buf`` (contiguous), in place; or, with ``send`` (of ``buf``'s
        shape and dtype), from ``send`` into ``buf``. Each rank's values are multiplied by
        ``prescale`` before the reduction and the result by ``postscale`` (Horovod's order;
        ``common.collectives.scale_factors`` computes both)."""
        self._unsupported("allreduce")

    def allgatherv(self, send, recv, counts) -> None:
        """``recv`` = every rank's ``send`` end to end; ``counts[r]`` elements from rank r."""
        self._unsupported("allgather")

    def bcast(self, buf, root: int) -> None:
        """In place, from ``root`` (a rank of this set)."""
        self._unsupported("broadcast")

    def alltoallv(self, send, send_counts, recv, recv_counts) -> None:
        """``send_counts[r]`` elements to rank r, ``recv_counts[r]`` from it, end to end."""
        self._unsupported("alltoall")

    def reduce_scatter(self, send, recv, counts, op: int) -> None:
        """Reduce ``send`` over the ranks; rank r receives the ``counts[r]`` elements of its
        block."""
        self._unsupported("reducescatter")

    def barrier(self) -> None:
        """Wait until every rank of the set arrives."""
        self._unsupported("barrier")

    # -- memory ----------------------------------------------------------------------------------
    def fusion_buffer(self, dtype, count: int):
        """A reusable device buffer of at least ``count`` elements (device backends)."""
        self._unsupported("fusion buffers")

    def bucket_memory(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of host memory (uint8, 64-byte aligned) that :meth:`allreduce` reduces in
        place without copying it first: the node's shared window. None when the backend has
        no such memory, or none left; the caller then uses memory of its own."""
        return None

    def fusion_memory(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of host memory (uint8, 64-byte aligned) to pack one fused group into,
        which :meth:`allreduce` then reduces where it lies: the node's shared window. The same
        memory at every call, so its contents last until the backend's next collective. None
        when the backend has no such memory, or not that much; the caller then uses its own."""
        return None

    # -- health and lifetime -----------------------------------------------------------------------
    def check_async_error(self) -> None:
        """Raise when the backend saw an asynchronous failure (NCCL: a lost peer or link);
        the host backends have none."""
        return None

    def abort(self) -> None:
        """After an engine error: end this set's device communicators at once, so that no
        device work waits for ever on a peer that is gone (NCCL: ``ncclCommAbort``); the host
        backends have none, and inherit this no-op."""

    def sub(self, ranks) -> Backend | None:
        """Collective over this set: a backend for ``ranks`` (None on a rank outside them)."""
        self._unsupported("process sets")

    def free(self) -> None:
        """Release the communicators; local (never waits for a peer). Memory peers may still
        read, or views of which may still be alive, stays mapped until the process exits."""
        return None

    def close(self) -> None:
        """Collective over the set, once every member agreed to stop (a normal shutdown):
        release what the members share (the node's shared window), then :meth:`free`."""
        self.free()
