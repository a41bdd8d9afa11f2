"""Run by every rank of ``mpirun -np N python -m pytest`` (test_native_reductions.py):
float16/bfloat16 sums with the native MPI operations, on the MPI backend directly and through
hpc_horovod's API.

With 2 ranks a sum is one reduction step, so the result is known bit for bit:
``round(float32(a) + float32(b))``. With more ranks MPI chooses the order of the steps; each
step rounds once, so the result is within ``steps * eps/2 * sum(|x|)`` of the exact sum, and every
rank must hold the same bits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import hpc_horovod as hvd
from hpc_horovod.backends.mpi import MpiBackend
from hpc_horovod.common import collectives

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()


def inputs(dtype: np.dtype, n: int, seed: int, specials: bool) -> list[np.ndarray]:
    """Every rank's input (each rank can compute all of them: they are seeded by rank)."""
    out = []
    for r in range(SIZE):
        rng = np.random.default_rng([seed, r])
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(dtype)
        if specials and n >= 8:
            x[:8] = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-7, -6e-8, 6e4], dtype=dtype)
            x[:8] = np.roll(x[:8], r)  # inf + -inf, inf + nan, 6e4 + 6e4 (overflow)...
        out.append(x)
    return out


def check_sum(got: np.ndarray, xs: list[np.ndarray], what: str, scale: float = 1.0,
              shared: bool = True) -> None:
    """``got`` is the sum of ``xs`` (times ``scale``); ``shared``: every rank holds it."""
    dtype = got.dtype
    if SIZE == 2 and scale == 1.0:
        with np.errstate(over="ignore", invalid="ignore"):
            want = (xs[0].astype(np.float32) + xs[1].astype(np.float32)).astype(dtype)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), what
        assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan]), (
            f"{what}: {np.count_nonzero(got.view(np.uint16) != want.view(np.uint16))} elements "
            "differ from round(float32(a) + float32(b))")
    else:
        exact = sum(x.astype(np.float64) for x in xs) * scale
        # each rounding (SIZE - 1 sums, plus the prescale) errs by at most half an ulp of a
        # value no larger than sum(|x|) * scale
        roundings = SIZE - 1 + (scale != 1.0)
        magnitude = sum(np.abs(x.astype(np.float64)) for x in xs) * scale
        bound = ml_dtypes.finfo(dtype).eps / 2 * roundings * magnitude
        error = np.abs(got.astype(np.float64) - exact)
        worst = int(np.argmax(error - bound))
        assert np.all(error <= bound + ml_dtypes.finfo(dtype).smallest_subnormal), (
            f"{what}: element {worst} is {got[worst]}, exact sum {exact[worst]}")
    if shared:
        bits = MPI.COMM_WORLD.allgather(got.view(np.uint16).tobytes())
        assert all(b == bits[0] for b in bits), f"{what}: ranks disagree"


@pytest.fixture(autouse=True)
def _stopped_engine():
    yield
    hvd.shutdown()


def test_backend() -> None:
    backend = MpiBackend(MPI.COMM_WORLD.Dup())
    for dtype in (F16, BF16):
        for n in (7, 1_000_003):  # small: one step; large: Open MPI's segmented ring
            xs = inputs(dtype, n, seed=n, specials=SIZE == 2)
            buf = xs[RANK].copy()
            backend.allreduce(buf, hvd.Sum)
            check_sum(buf, xs, f"backend allreduce {dtype} n={n}")
        xs = inputs(dtype, 10 * SIZE + 3, seed=5, specials=SIZE == 2)
        counts = [10] * SIZE
        counts[0] += 3
        recv = np.empty(counts[RANK], dtype)
        backend.reduce_scatter(xs[RANK], recv, counts, hvd.Sum)
        start = sum(counts[:RANK])
        check_sum(recv, [x[start:start + counts[RANK]] for x in xs], f"reduce_scatter {dtype}",
                  shared=False)
        try:
            backend.allreduce(xs[RANK].copy(), hvd.Max)
        except ValueError as e:
            assert "reduce it in float32" in str(e), e
        else:
            raise AssertionError("a half Max reached MPI without an error")
    backend.free()


def test_api() -> None:
    hvd.init()
    assert collectives.wire_dtype(F16, hvd.Sum) == F16
    assert collectives.wire_dtype(BF16, hvd.Average) == BF16
    assert collectives.wire_dtype(F16, hvd.Max) == np.float32  # no native Max: widened
    for dtype in (F16, BF16):
        xs = inputs(dtype, 4099, seed=11, specials=False)
        check_sum(hvd.allreduce(xs[RANK], op=hvd.Sum, name=f"sum.{dtype}"), xs, f"Sum {dtype}")
        check_sum(hvd.allreduce(xs[RANK], name=f"avg.{dtype}"), xs, f"Average {dtype}",
                  scale=1.0 / SIZE)
        inplace = xs[RANK].copy()
        hvd.allreduce_(inplace, op=hvd.Sum, name=f"inplace.{dtype}")
        check_sum(inplace, xs, f"in-place Sum {dtype}")
        parts = [(0, 3), (3, 1000), (1000, 1001), (1001, 4099)]  # fused into one buffer
        outs = hvd.grouped_allreduce([xs[RANK][a:b] for a, b in parts], op=hvd.Sum,
                                     name=f"group.{dtype}")
        check_sum(np.concatenate(outs), xs, f"grouped Sum {dtype}")
        top = hvd.allreduce(xs[RANK], op=hvd.Max, name=f"max.{dtype}")
        assert np.array_equal(top, np.max(np.stack(xs), axis=0)), f"Max {dtype}"
        rows = hvd.reducescatter(xs[RANK][:4096].reshape(1024, 4), op=hvd.Sum,
                                 name=f"rs.{dtype}")
        per = 1024 // SIZE + (1 if RANK < 1024 % SIZE else 0)
        start = 4 * sum(1024 // SIZE + (1 if r < 1024 % SIZE else 0) for r in range(RANK))
        check_sum(rows.reshape(-1), [x[start:start + 4 * per] for x in xs],
                  f"reducescatter {dtype}", shared=False)
    hvd.shutdown()

