"""Reduction ops, supported dtypes and the metadata every rank must agree on."""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

# Values follow horovod.common.basics so that pickled configs and user code keep working.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
            Product: "Product"}

bfloat16 = np.dtype(ml_dtypes.bfloat16)
SUPPORTED_DTYPES = tuple(
    np.dtype(d)
    for d in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, bfloat16,
              np.float32, np.float64, np.bool_)
)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
#: dtypes MPI cannot reduce natively; they are reduced in float32 (exact for min/max).
HALF_DTYPES = (np.dtype(np.float16), bfloat16)
_PLAIN_OPS = frozenset((Average, Sum, Min, Max, Product))


def check_dtype(dtype: np.dtype, kind: str, op: int | None = None) -> None:
    """Raise ValueError for a dtype (or a dtype/op pair) no backend can handle."""
    if not isinstance(op, (int, type(None))):
        raise ValueError(f"unknown reduction op {op!r}; use Average, Sum, Min, Max, Product or "
                         "Adasum")
    if dtype in _SUPPORTED and (op is None or (op in _PLAIN_OPS and dtype.kind != "b")):
        return  # the common case, kept cheap: it runs once per submitted tensor
    dtype = np.dtype(dtype)
    if dtype not in _SUPPORTED:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"{kind} does not support dtype {dtype}; supported dtypes: {names}")
    if op is not None:
        if op not in OP_NAMES:
            raise ValueError(f"unknown reduction op {op!r}; use Average, Sum, Min, Max, "
                             "Product or Adasum")
        if dtype == np.bool_ and op not in (Min, Max):
            raise ValueError(f"{kind} of bool tensors supports only op=Min (logical and) and "
                             f"op=Max (logical or), not {OP_NAMES[op]}")
        if op == Adasum and dtype.kind != "f" and dtype != bfloat16:
            raise ValueError(f"Adasum needs floating point tensors, not {dtype}")


class Signature(NamedTuple):
    """What every rank must agree on for one named tensor before it moves.

    For allgather and alltoall the first dimension may differ per rank and is stored as -1.
    """

    kind: str
    dtype: np.dtype | str
    shape: tuple[int, ...]
    op: int
    root: int
    prescale: float
    postscale: float
    device: bool = False  # a GPU buffer (cupy), moved by the NCCL backend


def request_type(sig: Signature) -> str:
    """Horovod's name for the kind of request (an Adasum allreduce is its own type there)."""
    if sig.kind == "allreduce" and sig.op == Adasum:
        return "ADASUM"
    return sig.kind.upper()


def mismatch_message(a: Signature, b: Signature) -> str | None:
    """Horovod's error text for two disagreeing signatures, or None when they agree.

    The checks run in Horovod's order (data type, operation, shape, scale factors, reduction op,
    root rank) so the first disagreement is reported as Horovod would. Reduction ops are named
    (Horovod prints the enum's number).
    """
    if a.dtype != b.dtype:
        return (f"Mismatched data types: One rank had type {a.dtype}, but another rank had "
                f"type {b.dtype}.")
    kind_a, kind_b = request_type(a), request_type(b)
    if kind_a != kind_b:
        return (f"Mismatched operations: One rank did an {kind_a}, but another rank did an "
                f"{kind_b}.")
    if a.shape != b.shape:
        if a.kind == "process_set_add":  # the "shape" of this request is the set's ranks
            return (f"Mismatched process sets: One rank added a process set of ranks "
                    f"{list(a.shape)}, but another rank added ranks {list(b.shape)}.")
        if len(a.shape) != len(b.shape):
            return (f"Mismatched {kind_a} tensor shapes: One rank sent a tensor of rank "
                    f"{len(a.shape)}, but another rank sent a tensor of rank {len(b.shape)}.")
        if a.shape[0] < 0:  # the first dimension may differ: name the one that does not
            dim = next(d for d in range(1, len(a.shape)) if a.shape[d] != b.shape[d])
            return (f"Mismatched {kind_a} tensor shapes: One rank sent a tensor with dimension "
                    f"{dim} equal to {a.shape[dim]}, but another rank sent a tensor with "
                    f"dimension {dim} equal to {b.shape[dim]}.")
        return (f"Mismatched {kind_a} tensor shapes: One rank sent a tensor of shape "
                f"{_shape(a.shape)}, but another rank sent a tensor of shape {_shape(b.shape)}.")
    if (a.prescale, a.postscale) != (b.prescale, b.postscale):
        return (f"Mismatched prescale and/or postscale factors: One rank sent factors "
                f"({a.prescale:g}, {a.postscale:g}), but another rank sent factors "
                f"({b.prescale:g}, {b.postscale:g}).")
    if a.op != b.op:
        return (f"Mismatched reduction operation: One rank sent reduction op {OP_NAMES[a.op]}, "
                f"but another rank sent reduction op {OP_NAMES[b.op]}.")
    if a.root != b.root:
        return (f"Mismatched {kind_a} root ranks: One rank specified root rank {a.root}, but "
                f"another rank specified root rank {b.root}.")
    if a.device != b.device:
        where = {True: "GPU", False: "CPU"}
        return (f"Mismatched devices: One rank sent a {where[a.device]} tensor, but another "
                f"rank sent a {where[b.device]} tensor.")
    return None


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
