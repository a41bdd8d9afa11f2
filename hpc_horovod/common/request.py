"""One submitted collective: its inputs, its agreed signature and, once done, its result."""

from __future__ import annotations

import time

import numpy as np

from .types import Signature

#: kinds whose first dimension may differ between ranks
VARIABLE_FIRST_DIM = ("allgather", "alltoall")


class Request:
    """A pending collective on this rank. Completed by the engine thread, read by the caller."""

    __slots__ = ("kind", "name", "tensor", "output", "op", "root", "prescale", "postscale",
                 "splits", "process_set_id", "signature", "handle", "result", "error", "done",
                 "submitted_at", "payload", "ready_event", "done_event")

    def __init__(self, kind: str, name: str, tensor: np.ndarray | None = None, *,
                 output: np.ndarray | None = None, op: int = 0, root: int = -1,
                 prescale: float = 1.0, postscale: float = 1.0,
                 splits: np.ndarray | None = None, process_set_id: int = 0, payload=None):
        self.kind = kind
        self.name = name
        self.tensor = tensor
        self.output = output
        self.op = op
        self.root = root
        self.prescale = float(prescale)
        self.postscale = float(postscale)
        self.splits = splits
        self.process_set_id = process_set_id
        self.payload = payload
        if tensor is not None:
            shape = tuple(tensor.shape)
            if kind in VARIABLE_FIRST_DIM and shape:
                shape = (-1,) + shape[1:]
            dtype = tensor.dtype
            device = not isinstance(tensor, np.ndarray)
        else:
            shape, dtype, device = (), "", False
        self.signature = Signature(kind, dtype, shape, op, root, self.prescale, self.postscale,
                                   device)
        # GPU only: recorded on the producer's stream at submission / on the backend's stream
        # when the result is written (hpc_horovod.backends.nccl.ready_event / done_event).
        self.ready_event = None
        self.done_event = None
        self.handle = -1
        self.result = None
        self.error: BaseException | None = None
        self.done = False
        self.submitted_at = time.monotonic()
