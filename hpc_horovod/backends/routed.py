"""A host backend and a device backend over the same ranks, as one: each call goes to the backend
of the memory its buffer lives in (numpy arrays: the host backend), the negotiation and the other
small host collectives to the host backend. :func:`hpc_horovod.backends.compose` builds it.

A collective whose peer died never ends on the device, and the host knows nothing of it: the
negotiation therefore asks the device backend for asynchronous errors before it starts and at
every poll while it waits for peers (:class:`DeviceWatch`), so that such a failure ends the
wait at once instead of after the peer timeout."""

from __future__ import annotations

import numpy as np

from .base import Backend


class DeviceWatch:
    """The engine's alarm (``.error``: a peer failed, see ``common.watch``) as the waits of the
    host backend see it, with the device backend's asynchronous error check run at every look:
    that check raises HorovodInternalError itself."""

    __slots__ = ("alarm", "check")

    def __init__(self, alarm, check):
        self.alarm, self.check = alarm, check

    @property
    def error(self):
        self.check()
        return None if self.alarm is None else self.alarm.error


class RoutedBackend(Backend):
    def __init__(self, host: Backend, device: Backend):
        self.host, self.on_device = host, device
        self.name = device.name
        self.rank, self.size = host.rank, host.size
        self.device = device.device

    def _for(self, buf) -> Backend:
        return self.host if isinstance(buf, np.ndarray) else self.on_device

    # -- negotiation ---------------------------------------------------------------------------
    def negotiate(self, words: np.ndarray, timeout_s: float, alarm=None) -> None:
        check = self.on_device.check_async_error
        check()
        self.host.negotiate(words, timeout_s, DeviceWatch(alarm, check))

    def agree(self, obj, decide, timeout_s: float = 0.0, alarm=None):
        check = self.on_device.check_async_error
        return self.host.agree(obj, decide, timeout_s, DeviceWatch(alarm, check))

    def allgather_ints(self, values: np.ndarray, timeout_s: float = 0.0,
                       alarm=None) -> np.ndarray:
        check = self.on_device.check_async_error
        return self.host.allgather_ints(values, timeout_s, DeviceWatch(alarm, check))

    def alltoall_ints(self, values: np.ndarray) -> np.ndarray:
        return self.host.alltoall_ints(values)

    # -- data ------------------------------------------------------------------------------------
    def allreduce(self, buf, op: int, send=None, prescale: float = 1.0,
                  postscale: float = 1.0) -> None:
        self._for(buf).allreduce(buf, op, send, prescale, postscale)

    def allgatherv(self, send, recv, counts) -> None:
        self._for(send).allgatherv(send, recv, counts)

    def bcast(self, buf, root: int) -> None:
        self._for(buf).bcast(buf, root)

    def alltoallv(self, send, send_counts, recv, recv_counts) -> None:
        self._for(send).alltoallv(send, send_counts, recv, recv_counts)

    def reduce_scatter(self, send, recv, counts, op: int) -> None:
        self._for(send).reduce_scatter(send, recv, counts, op)

    def barrier(self) -> None:
        self.host.barrier()

    # -- memory, health, lifetime --------------------------------------------------------------
    def fusion_buffer(self, dtype, count: int):
        return self.on_device.fusion_buffer(dtype, count)

    def bucket_memory(self, nbytes: int) -> np.ndarray | None:
        return self.host.bucket_memory(nbytes)

    def fusion_memory(self, nbytes: int) -> np.ndarray | None:
        return self.host.fusion_memory(nbytes)

    def check_async_error(self) -> None:
        self.on_device.check_async_error()

    def node_levels(self):
        """The device backend's node levels (``NcclBackend.node_levels``), for Adasum."""
        return self.on_device.node_levels()

    def abort(self) -> None:
        self.on_device.abort()
        self.host.abort()

    def sub(self, ranks) -> RoutedBackend | None:
        host, device = self.host.sub(ranks), self.on_device.sub(ranks)
        return None if host is None else RoutedBackend(host, device)

    def free(self) -> None:
        self.on_device.free()
        self.host.free()

    def close(self) -> None:
        self.on_device.close()
        self.host.close()
