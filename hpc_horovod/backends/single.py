"""Size-1 backend: every collective is a local copy. Needs no MPI, so a laptop script, a notebook
or a one-task batch job runs the same code path as a multi-node job."""

from __future__ import annotations

import numpy as np

from .base import Backend
from .scaling import scale_inplace, scale_into


class SingleBackend(Backend):
    name = "single"
    rank = 0
    size = 1

    def negotiate(self, words: np.ndarray, timeout_s: float, alarm=None) -> None:
        return None

    def agree(self, obj, decide, timeout_s: float = 0.0, alarm=None):
        return decide([obj])

    def allgather_ints(self, values: np.ndarray, timeout_s: float = 0.0,
                       alarm=None) -> np.ndarray:
        return values.reshape(1, -1).copy()

    def alltoall_ints(self, values: np.ndarray) -> np.ndarray:
        return values.copy()

    def allreduce(self, buf: np.ndarray, op: int, send: np.ndarray | None = None,
                  prescale: float = 1.0, postscale: float = 1.0) -> None:
        if send is not None or prescale != 1.0:
            scale_into(buf if send is None else send, prescale, buf)
        scale_inplace(buf, postscale)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts) -> None:
        recv.reshape(-1)[: send.size] = send.reshape(-1)

    def bcast(self, buf: np.ndarray, root: int) -> None:
        return None

    def alltoallv(self, send, send_counts, recv, recv_counts) -> None:
        recv.reshape(-1)[: send.size] = send.reshape(-1)

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts, op: int) -> None:
        recv.reshape(-1)[:] = send.reshape(-1)[: recv.size]

    def barrier(self) -> None:
        return None

    def sub(self, ranks) -> SingleBackend:
        return SingleBackend()

    def free(self) -> None:
        return None
