"""One submitted collective: its inputs, its agreed signature and, once done, its result."""

from __future__ import annotations

import numpy as np

from .types import Signature, check_dtype

#: kinds whose first dimension may differ between ranks
VARIABLE_FIRST_DIM = ("allgather", "alltoall")

#: Signatures are interned: a training step submits the same few hundred (kind, dtype, shape,
#: op, scales) combinations every time, and one dict lookup is cheaper than validating and
#: building a tuple of eight fields; the engine then compares them by identity.
_SIGNATURES: dict[tuple, Signature] = {}
_MAX_SIGNATURES = 1 << 14


def signature_of(kind: str, tensor, op: int | None = None, root: int = -1,
                 prescale: float = 1.0, postscale: float = 1.0) -> Signature:
    """The (interned) signature of ``kind`` on ``tensor``; the first time a combination is
    seen, its dtype and op are checked (ValueError when no backend handles them)."""
    key = (kind, tensor.dtype, tensor.shape, op, root, prescale, postscale, type(tensor))
    try:
        sig = _SIGNATURES.get(key)
    except TypeError:  # an unhashable op: check_dtype names it
        sig = None
    if sig is None:
        check_dtype(tensor.dtype, kind, op)
        shape = tuple(tensor.shape)
        if kind in VARIABLE_FIRST_DIM and shape:
            shape = (-1,) + shape[1:]
        if len(_SIGNATURES) >= _MAX_SIGNATURES:  # e.g. allgathers of ever-changing shapes
            _SIGNATURES.clear()
        sig = _SIGNATURES[key] = Signature(
            kind, tensor.dtype, shape, 0 if op is None else op, root, float(prescale),
            float(postscale), not isinstance(tensor, np.ndarray))
    return sig


def control_signature(kind: str, shape: tuple[int, ...] = (), root: int = -1) -> Signature:
    """The signature of a request without a tensor (barrier, join, process set changes)."""
    return Signature(kind, "", shape, 0, root, 1.0, 1.0, False)


class Request:
    """A pending collective on this rank. Completed by the engine thread, read by the caller.

    Kept small and built from positional arguments: a training step creates one per bucket
    of gradients, or one per tensor for the other ops.
    """

    __slots__ = ("name", "tensor", "signature", "process_set_id", "output", "splits", "key",
                 "handle", "result", "error", "done", "submitted_at", "ready_event", "done_event")

    def __init__(self, name: str, tensor, signature: Signature, process_set_id: int = 0,
                 output=None, splits: np.ndarray | None = None):
        self.name = name
        self.tensor = tensor
        self.signature = signature
        self.process_set_id = process_set_id
        self.output = output
        self.splits = splits
        self.key = (process_set_id, name)
        # GPU only: recorded on the producer's stream at submission / on the backend's stream
        # when the result is written (hpc_horovod.backends.nccl.ready_event / done_event).
        self.ready_event = None
        self.done_event = None
        # An op with an output returns it: its result is known from the start (read once done).
        self.result = output
        self.error: BaseException | None = None
        self.done = False
        # submitted_at: set when the engine admits it (the stall check's clock)

    @property
    def kind(self) -> str:
        return self.signature.kind
