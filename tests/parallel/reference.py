"""Shared by the worker scripts: every rank's input, computable on any rank, and numpy
references for the reductions (so each rank checks its result against the whole job's data)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from hpc_horovod.common.types import (
    SUPPORTED_DTYPES,
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    bfloat16,
)

NUMERIC = [d for d in SUPPORTED_DTYPES if d != np.bool_]
FLOATS = [d for d in NUMERIC if d.kind == "f" or d == bfloat16]


def inputs(size: int, dtype, shape, seed: int, low: int = -4, high: int = 4) -> list[np.ndarray]:
    """Rank r's tensor for ``seed``, for every r. Small integers: sums, products and averages
    stay exact in every dtype (bfloat16 and float16 included), whatever MPI's summation order."""
    dtype = np.dtype(dtype)
    out = []
    for r in range(size):
        rng = np.random.default_rng([seed, r])
        if dtype == np.bool_:
            out.append(rng.integers(0, 2, shape).astype(bool))
        else:
            lo = 0 if dtype.kind == "u" else low
            out.append(rng.integers(lo, high + 1, shape).astype(dtype))
    return out


def tolerance(dtype) -> dict:
    """Exact for integers. Floats: the engine averages by scaling each rank's share before the
    sum (and 16-bit floats may be summed in 16 bits), so allow a few roundings of inputs <= 4."""
    dtype = np.dtype(dtype)
    if dtype not in FLOATS:
        return {"rtol": 0, "atol": 0}
    eps = float(ml_dtypes.finfo(dtype).eps)
    return {"rtol": 4 * eps, "atol": 32 * eps}


def reduce_reference(xs: list[np.ndarray], op: int, prescale: float = 1.0,
                     postscale: float = 1.0) -> np.ndarray:
    """What an allreduce of ``xs`` must give, computed in float64/int64 then cast back.

    Integer tensors are scaled like a cast (truncation), as the engine documents; the average of
    integers is the truncated quotient.
    """
    dtype = xs[0].dtype
    size = len(xs)
    if op == Adasum:
        return adasum_reference(xs, prescale, postscale).astype(dtype)
    if dtype == np.bool_:
        stack = np.stack(xs)
        return stack.all(axis=0) if op == Min else stack.any(axis=0)
    if dtype in FLOATS:
        stack = np.stack([x.astype(np.float64) for x in xs]) * prescale
        combined = {Sum: stack.sum, Average: stack.sum, Min: stack.min, Max: stack.max,
                    Product: stack.prod}[op](axis=0)
        combined = combined * postscale / (size if op == Average else 1)
        return combined.astype(dtype)
    scaled = [np.trunc(x.astype(np.float64) * prescale).astype(np.int64) if prescale != 1.0
              else x.astype(np.int64) for x in xs]
    stack = np.stack(scaled)
    combined = {Sum: stack.sum, Average: stack.sum, Min: stack.min, Max: stack.max,
                Product: stack.prod}[op](axis=0)
    factor = postscale / (size if op == Average else 1)
    if factor != 1.0:
        combined = np.trunc(combined * factor)
    return combined.astype(dtype)


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Maleki et al.: (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b."""
    dot = a @ b
    ca = 1.0 - dot / (2 * (a @ a)) if a @ a > 0 else 1.0
    cb = 1.0 - dot / (2 * (b @ b)) if b @ b > 0 else 1.0
    return ca * a + cb * b


def adasum_reference(xs, prescale=1.0, postscale=1.0) -> np.ndarray:
    """Binary tree over ranks in order: ((r0, r1), (r2, r3)), an odd one out passes up."""
    shape = xs[0].shape
    vectors = [x.astype(np.float64).reshape(-1) * prescale for x in xs]
    while len(vectors) > 1:
        paired = [adasum_pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors) - 1, 2)]
        if len(vectors) % 2:
            paired.append(vectors[-1])
        vectors = paired
    return (vectors[0] * postscale).reshape(shape)


def reducescatter_rows(rows: int, size: int) -> list[int]:
    """Horovod's split of dim 0: the first ``rows % size`` ranks get one more row."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]
