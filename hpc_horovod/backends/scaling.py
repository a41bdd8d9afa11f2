"""Multiplying host arrays by Horovod's scale factors as numpy does it: in float32 for
float16, bfloat16 and float32, in float64 for float64 and integers (truncated back). The
backends that reduce with MPI scale around the call; the native slice reduction does the same
arithmetic inside its pass (``src_native/slices.c``)."""

from __future__ import annotations

import numpy as np

from ..common.types import HALF_DTYPES


def scale_into(src, factor: float, dst, xp=np) -> None:
    """``dst = src * factor`` (a copy when ``factor`` is 1); ``xp``: the array module of
    ``src`` and ``dst`` (cupy for device arrays, which take the same arithmetic)."""
    if factor == 1.0:
        dst[...] = src
    elif dst.dtype.kind == "f" or dst.dtype in HALF_DTYPES:
        xp.multiply(src, factor, out=dst, dtype=np.float32 if dst.dtype.itemsize < 4
                    else dst.dtype, casting="unsafe")
    else:
        xp.multiply(src, factor, out=dst, casting="unsafe")


def scale_inplace(buf: np.ndarray, factor: float) -> None:
    if factor != 1.0:
        scale_into(buf, factor, buf)
