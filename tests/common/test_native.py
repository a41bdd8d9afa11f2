"""hpc_horovod._native on one process: the 16-bit float sums MPI runs, and pack/unpack, checked
bit for bit against numpy (and ml_dtypes for bfloat16) with every SIMD flavour this CPU has."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from support import native_or_skip

_native = native_or_skip()

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


@pytest.fixture(params=_native.available_kernels())
def kernels(request):
    previous = _native.use_kernels(request.param)
    yield request.param
    _native.use_kernels(previous)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit patterns, except that any nan matches any nan (payloads are not specified)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    with np.errstate(invalid="ignore"):  # signaling nans
        got_nan, want_nan = np.isnan(got), np.isnan(want)
    np.testing.assert_array_equal(got_nan, want_nan)
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
    mismatch = np.flatnonzero(got.view(bits)[~got_nan] != want.view(bits)[~got_nan])
    assert mismatch.size == 0, (
        f"{mismatch.size} elements differ, first: got {got[~got_nan][mismatch[:5]]}, "
        f"want {want[~got_nan][mismatch[:5]]}")


def every_half(dtype: np.dtype) -> np.ndarray:
    """All 65536 bit patterns of a 16-bit float type: zeros, subnormals, inf, nan included."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)


def hard_floats(dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    """float32 values that stress rounding to ``dtype``: exact ties between neighbours, values
    next to ties, the overflow edge, subnormals and random bit patterns."""
    halves = every_half(dtype)
    finite = halves[np.isfinite(halves.astype(np.float32))].astype(np.float32)
    finite = np.unique(finite)
    ties = (finite[:-1] / 2 + finite[1:] / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(ties, np.float32(np.inf)),
                           np.nextafter(ties, np.float32(-np.inf))])
    edges = np.array([65504, 65519.996, 65520, 65536, 3.4e38, np.inf, -np.inf, np.nan, 0.0,
                      -0.0, 2.0 ** -24, 2.0 ** -25, 2.0 ** -26, 1.5 * 2.0 ** -25, 2.0 ** -14],
                     dtype=np.float32)
    random_bits = rng.integers(0, 1 << 32, size=50_000, dtype=np.uint32).view(np.float32)
    scaled = (rng.standard_normal(50_000) * 10.0 ** rng.uniform(-9, 6, 50_000)).astype(np.float32)
    return np.concatenate([ties, near, edges, -edges, random_bits, scaled])


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_reduce_sum_rounds_the_float32_sum_to_nearest_even(kernels, dtype):
    rng = np.random.default_rng(0)
    a = every_half(dtype)
    for b in (rng.permutation(a), a[::-1].copy(), a.copy()):
        with np.errstate(over="ignore", invalid="ignore"):  # inf - inf
            want = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)
        inout = b.copy()
        _native.reduce_sum(a, inout)
        assert_same(inout, want)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_reduce_sum_into_a_third_array_leaves_its_inputs(kernels, dtype):
    rng = np.random.default_rng(2)
    for n in (0, 1, 7, 8, 9, 16, 17, 1000):
        a, b = ((rng.standard_normal(n) * 100).astype(dtype) for _ in range(2))
        a0, b0 = a.copy(), b.copy()
        want = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)
        out = np.full(n, 7, dtype)
        _native.reduce_sum(a, b, out)
        assert_same(out, want)
        assert_same(a, a0)
        assert_same(b, b0)
        _native.reduce_sum(a, b, out=a)  # out may be an input
        assert_same(a, want)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_kernels_cover_odd_lengths(kernels, dtype):
    """Lengths across the 16-wide and 8-wide vector loops and the scalar tail."""
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 24, 31, 33, 47):
        a, b = (rng.standard_normal(n).astype(dtype) for _ in range(2))
        want = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)
        _native.reduce_sum(a, b)
        assert_same(b, want)


def numpy_scaled(src: np.ndarray, factor: float, dtype: np.dtype) -> np.ndarray:
    """What the numpy fusion path computes for one tensor (overflow to inf is expected)."""
    out = np.empty(src.shape, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        if factor == 1.0:
            out[...] = src
        else:
            np.multiply(src, factor, out=out, dtype=F64 if dtype == F64 else F32,
                        casting="unsafe")
    return out


def source_values(dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    if dtype in (F16, BF16):
        return rng.permutation(every_half(dtype))
    if dtype == F32:
        return rng.permutation(np.concatenate([hard_floats(F16, rng), hard_floats(BF16, rng)]))
    return rng.standard_normal(20_000) * 10.0 ** rng.uniform(-300, 300, 20_000)


# sizes cross the 8-wide vector loops and the 2048-element staging blocks
SIZES = (0, 1, 7, 8, 17, 2047, 2049, 4099, 16)
PAIRS = [(F32, F32), (F64, F64), (F16, F16), (BF16, BF16), (F16, F32), (BF16, F32),
         (F32, F16), (F32, BF16), (F16, BF16)]


@pytest.mark.parametrize("factor", [1.0, 0.125, 1 / 3])
@pytest.mark.parametrize("src_dtype,wire_dtype", PAIRS,
                         ids=[f"{a.name}-{b.name}" for a, b in PAIRS])
def test_pack_and_unpack_match_numpy(kernels, src_dtype, wire_dtype, factor):
    rng = np.random.default_rng(2)
    values = source_values(src_dtype, rng)
    arrays = []
    for n in SIZES:
        arrays.append(np.resize(values, n).reshape(-1, 1) if n else values[:0])
        values = np.roll(values, 997)
    total = sum(a.size for a in arrays)
    out = np.full(total + 3, 7, dtype=wire_dtype)

    assert _native.pack(arrays, out, factor) == total
    want = np.concatenate([numpy_scaled(a.reshape(-1), factor, wire_dtype) for a in arrays])
    assert_same(out[:total], want)
    assert_same(out[total:], np.full(3, 7, dtype=wire_dtype))  # the tail is left alone

    outputs = [np.empty(a.shape, src_dtype) for a in arrays]
    assert _native.unpack(out, outputs, factor=2.0) == total
    offset = 0
    for got in outputs:
        seg = out[offset:offset + got.size]
        offset += got.size
        assert_same(got.reshape(-1), numpy_scaled(seg, 2.0, src_dtype))


def numpy_reduce(inputs: list[np.ndarray], op: int, pre: float, post: float) -> np.ndarray:
    """reduce_slices' documented result, step by step in numpy (32/64-bit floats)."""
    ufunc = {1: np.add, 3: np.minimum, 4: np.maximum, 5: np.multiply}[op]
    dtype = inputs[0].dtype
    acc = numpy_scaled(inputs[0], pre, dtype)
    for x in inputs[1:]:
        acc = ufunc(acc, numpy_scaled(x, pre, dtype))
    return numpy_scaled(acc, post, dtype)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("op", [1, 3, 4, 5], ids=["sum", "min", "max", "product"])
@pytest.mark.parametrize("pre,post", [(1.0, 1.0), (1.0, 0.5), (1 / 3, 1.0), (0.25, 1 / 3)])
def test_reduce_slices_match_numpy_with_outputs_among_the_inputs(dtype, op, pre, post):
    """1 to 4 inputs into 1 to 3 outputs, separate or the inputs themselves (as the node's
    stage writes its own slice and every peer's), across the 2048-element blocks."""
    rng = np.random.default_rng(5)
    for n in (1, 7, 2047, 2049, 5000):
        for k in (1, 2, 3, 4):
            values = [rng.standard_normal(n).astype(dtype) for _ in range(k)]
            want = numpy_reduce(values, op, pre, post)
            for among in (False, True):
                for m in (1, 2, 3):
                    inputs = [v.copy() for v in values]
                    outputs = [np.full(n, 7, dtype) for _ in range(m)]
                    if among:  # the last input first, as rank k-1 of a node passes its own
                        outputs[:min(m, k)] = inputs[::-1][:min(m, k)]
                    _native.reduce_slices(inputs, outputs, op, pre, post)
                    for out in outputs:
                        assert_same(out, want)


def test_large_pack_releases_the_gil_and_stays_exact():
    """Above 64 KiB the copy runs without the GIL; another thread keeps running meanwhile."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(1 << 18).astype(np.float16) for _ in range(8)]
    out = np.empty(8 << 18, F32)
    _native.pack(arrays, out, 0.5)
    assert_same(out, np.concatenate([numpy_scaled(a, 0.5, F32) for a in arrays]))


def test_in_place_unpack_of_the_same_memory():
    buf = np.arange(10, dtype=np.float32)
    views = [buf[:4], buf[4:]]
    _native.unpack(buf, views, 3.0)
    np.testing.assert_array_equal(buf, np.arange(10, dtype=np.float32) * 3)


def test_non_float_types_copy_unscaled():
    arrays = [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32)]
    out = np.empty(8, np.int32)
    assert _native.pack(arrays, out) == 8
    np.testing.assert_array_equal(out, np.concatenate(arrays))
    back = [np.empty(5, np.int32), np.empty(3, np.int32)]
    _native.unpack(out, back)
    np.testing.assert_array_equal(back[1], arrays[1])
    bools = np.array([True, False])
    flags = np.empty(2, np.bool_)
    _native.pack([bools], flags)
    np.testing.assert_array_equal(flags, bools)


def read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@pytest.mark.parametrize("call,error,text", [
    (lambda: _native.pack([np.ones(4, F32)], np.empty(3, F32)), ValueError,
     "out holds 3 elements but the arrays hold 4"),
    (lambda: _native.unpack(np.ones(3, F32), [np.empty(4, F32)]), ValueError,
     "buf holds 3 elements but the outputs hold 4"),
    (lambda: _native.pack([np.ones((4, 4), F32)[:, 0]], np.empty(4, F32)), ValueError,
     "arrays[0] must be a C-contiguous array"),
    (lambda: _native.pack([np.ones((4, 4), BF16)[:, 0]], np.empty(4, BF16)), ValueError,
     "arrays[0] must be a C-contiguous array"),
    (lambda: _native.pack([np.ones(4, F32)], np.ones(4, F32)[::2]), ValueError,
     "out must be a writable C-contiguous array"),
    (lambda: _native.unpack(np.ones(4, F32), [read_only(np.ones(4, F32))]), ValueError,
     "outputs[0] must be a writable C-contiguous array"),
    (lambda: _native.pack([[1.0, 2.0]], np.empty(2, F32)), TypeError,
     "arrays[0] must be a C-contiguous array"),
    (lambda: _native.pack(5, np.empty(4, F32)), TypeError,
     "arrays must be a sequence of arrays"),
    (lambda: _native.pack([np.ones(4, np.int32)], np.empty(4, np.int32), 2.0), TypeError,
     "scaling needs float16, bfloat16, float32 or float64"),
    (lambda: _native.pack([np.ones(4, np.int32)], np.empty(4, np.int64)), TypeError,
     "only copy to the same type"),
    (lambda: _native.pack([np.ones(4, F64)], np.empty(4, F32)), TypeError,
     "cannot copy arrays[0] (float64) into out (float32)"),
    (lambda: _native.reduce_sum(np.ones(4, F16), np.ones(4, BF16)), TypeError,
     "must both be float16 or both bfloat16, not float16 and bfloat16"),
    (lambda: _native.reduce_sum(np.ones(4, F32), np.ones(4, F32)), TypeError,
     "not float32 and float32"),
    (lambda: _native.reduce_sum(np.ones(4, F16), np.ones(5, F16)), ValueError,
     "src has 4 elements but inout has 5"),
    (lambda: _native.reduce_sum(np.ones(4, F16), np.ones(4, F16), np.empty(3, F16)), ValueError,
     "out must be 4 elements of float16, not 3 of float16"),
    (lambda: _native.reduce_sum(np.ones(4, F16), np.ones(4, F16), np.empty(4, BF16)), ValueError,
     "out must be 4 elements of float16, not 4 of bfloat16"),
    (lambda: _native.half_sum_op("float32"), ValueError, "float16 or bfloat16, not float32"),
    (lambda: _native.use_kernels("avx1024"), ValueError, "this CPU cannot run 'avx1024'"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_gets_a_clear_error(call, error, text):
    with pytest.raises(error) as info:
        call()
    assert text in str(info.value)


def test_the_fastest_flavour_is_chosen_at_import():
    assert _native.kernels() == _native.available_kernels()[-1]
    assert _native.available_kernels()[0] == "scalar"


def test_half_sum_needs_mpi_initialized():
    """The operations exist only once MPI runs: before, the engine must widen to float32."""
    script = (
        "from hpc_horovod import _native\n"
        "print(_native.has_half_sum())\n"
        "try:\n"
        "    _native.half_sum_op('float16')\n"
        "except RuntimeError as e:\n"
        "    print('RuntimeError', e)\n"
        "from mpi4py import MPI\n"
        "print(_native.has_half_sum())\n"
        "op = MPI.Op.fromhandle(_native.half_sum_op('bfloat16'))\n"
        "print(op.is_commutative, op.is_predefined)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "False"
    assert lines[1].startswith("RuntimeError half_sum_op: MPI is not initialized")
    assert lines[2:] == ["True", "True False"]
