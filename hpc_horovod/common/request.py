"""What one collective asks of the engine: a :class:`Request` (its inputs, its agreed signature
and, once done, its result), and the builders every binding calls to turn an op's arguments into
one, checked the same way for numpy, torch and TensorFlow (``allreduce_request``, ...). A
builder's ``process_set`` None is the global set."""

from __future__ import annotations

import warnings

import numpy as np

from .types import Adasum, Average, Signature, Sum, check_dtype

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


# -- builders --------------------------------------------------------------------------------------
def resolve_op(op: int | None, average: bool | None) -> int:
    """Horovod's rules for the deprecated ``average=`` argument."""
    if average is not None:
        if op is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of "
                             "them.")
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else op


def _global_set():
    from .basics import global_process_set  # basics imports this module
    return global_process_set


def process_set_id(process_set) -> int:
    """The id of ``process_set`` (None: the global set's, 0); ValueError once it was removed."""
    if process_set is None:
        return 0
    ps_id = process_set.process_set_id
    if ps_id is None:
        raise ValueError(f"{process_set} is not registered (was it removed?)")
    return ps_id


def _name(name: str | None, ps_id: int, kind: str) -> str:
    """``name``, or Horovod's automatic name (the runtime's counters) when it is None."""
    if name is not None:
        return name
    from .basics import next_name  # basics imports this module
    return next_name(ps_id, kind)


def allreduce_request(array: np.ndarray, *, name=None, op=None, average=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=None, output=None) -> Request:
    if op is None or average is not None:
        op = resolve_op(op, average)
    ps_id = 0 if process_set is None else process_set.process_set_id
    if ps_id is None or name is None:
        ps_id = process_set_id(process_set)
        name = _name(name, ps_id, "allreduce")
    sig = signature_of("allreduce", array, op, -1, prescale_factor, postscale_factor)
    return Request(name, array, sig, ps_id, output)


def group_names(name: str | None, n: int, ps_id: int, kind: str) -> list[str]:
    base = _name(name, ps_id, f"grouped_{kind}")
    return [f"{base}.{i}" for i in range(n)]


def allgather_request(array: np.ndarray, *, name=None, process_set=None):
    if array.ndim == 0:
        array = array.reshape(1)
    ps_id = process_set_id(process_set)
    return Request(_name(name, ps_id, "allgather"), array, signature_of("allgather", array),
                   ps_id)


def broadcast_request(array: np.ndarray, root_rank: int, *, name=None,
                      process_set=None, output=None) -> Request:
    """``root_rank`` is a global rank, as in Horovod; it must belong to ``process_set``."""
    process_set = _global_set() if process_set is None else process_set
    ps_id = process_set_id(process_set)
    sig = signature_of("broadcast", array, root=process_set.rank_of(root_rank))
    return Request(_name(name, ps_id, "broadcast"), array, sig, ps_id, output)


def alltoall_request(array: np.ndarray, splits=None, *, name=None,
                     process_set=None) -> Request:
    check_dtype(array.dtype, "alltoall")  # before the shape checks below
    if array.ndim == 0:
        array = array.reshape(1)
    process_set = _global_set() if process_set is None else process_set
    ps_id = process_set_id(process_set)
    n = process_set.size()
    if splits is not None:
        splits = np.asarray(splits)
        if splits.size and splits.dtype.kind not in "iu":
            raise ValueError(f"alltoall: splits must be integers, not {splits.dtype}")
        splits = splits.astype(np.int64).reshape(-1)
        if splits.size != n:
            raise ValueError(f"alltoall: splits has {splits.size} entries but the process set "
                             f"has {n} ranks")
        if (splits < 0).any() or int(splits.sum()) != array.shape[0]:
            raise ValueError(f"alltoall: splits {splits.tolist()} must be non-negative and sum "
                             f"to the first dimension {array.shape[0]}")
    elif array.shape[0] % n:
        raise ValueError(f"alltoall: the first dimension ({array.shape[0]}) is not divisible "
                         f"by the number of ranks ({n}); pass splits")
    return Request(_name(name, ps_id, "alltoall"), array, signature_of("alltoall", array),
                   ps_id, splits=splits)


def reducescatter_request(array: np.ndarray, *, name=None, op=None,
                          process_set=None, prescale_factor=1.0,
                          postscale_factor=1.0) -> Request:
    op = Average if op is None else op
    check_dtype(array.dtype, "reducescatter", op)
    if array.ndim == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    if op == Adasum:
        raise ValueError("reducescatter does not support Adasum")
    ps_id = process_set_id(process_set)
    sig = signature_of("reducescatter", array, op, -1, prescale_factor, postscale_factor)
    return Request(_name(name, ps_id, "reducescatter"), array, sig, ps_id)
