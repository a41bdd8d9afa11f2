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
        if op == Adasum and dtype.kind != "f":
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


ARTICLE = {"allreduce": "an", "allgather": "an", "alltoall": "an"}


def mismatch_message(a: Signature, b: Signature) -> str | None:
    """Horovod's error text for two disagreeing signatures, or None when they agree."""
    if a.kind != b.kind:
        return (f"Mismatched operations: One rank did {ARTICLE.get(a.kind, 'a')} {a.kind}, "
                f"but another rank did {ARTICLE.get(b.kind, 'a')} {b.kind}.")
    if a.dtype != b.dtype:
        return (f"Mismatched data types: One rank had type {a.dtype}, but another rank had "
                f"type {b.dtype}.")
    if a.shape != b.shape:
        if len(a.shape) != len(b.shape):
            return (f"Mismatched {a.kind} tensor shapes: One rank sent a tensor of rank "
                    f"{len(a.shape)}, but another rank sent a tensor of rank {len(b.shape)}.")
        return (f"Mismatched {a.kind} tensor shapes: One rank sent a tensor of shape "
                f"{_shape(a.shape)}, but another rank sent a tensor of shape {_shape(b.shape)}.")
    if a.op != b.op:
        return (f"Mismatched reduction operations: One rank specified {OP_NAMES[a.op]}, but "
                f"another rank specified {OP_NAMES[b.op]}.")
    if a.root != b.root:
        return (f"Mismatched {a.kind} root ranks: One rank specified root rank {a.root}, but "
                f"another rank specified root rank {b.root}.")
    if a.prescale != b.prescale:
        return (f"Mismatched prescale factors: One rank sent factor {a.prescale}, but another "
                f"rank sent factor {b.prescale}.")
    if a.postscale != b.postscale:
        return (f"Mismatched postscale factors: One rank sent factor {a.postscale}, but "
                f"another rank sent factor {b.postscale}.")
    return None


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("*" if d < 0 else str(d) for d in shape) + "]"
