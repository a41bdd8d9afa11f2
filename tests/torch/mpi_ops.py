"""Every torch op on every dtype, autograd, handles and errors: run by every rank of
``mpirun -np N python -m pytest`` (test_torch_parallel.py).

Each check computes the expected value locally from what every rank is known to hold
(``value(rank)`` below), so any rank count works.
"""

import numpy as np
import pytest
import torch

import hpc_horovod.torch as hvd
from hpc_horovod.common.topology import detect

torch.set_num_threads(1)
WORLD = max(detect().size, 2)  # (a process alone only collects the checks)
PAIR = hvd.ProcessSet([WORLD - 2, WORLD - 1])  # the last two ranks
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
ALL = FLOATS + INTS + (torch.bool,)


@pytest.fixture(autouse=True)
def _job():
    """A running engine (a new one after a check that stopped it); R and N its rank and size."""
    global R, N
    hvd.init(process_sets=[PAIR])
    R, N = hvd.rank(), hvd.size()


def value(rank, dtype, shape=(2, 3)):
    """What ``rank`` contributes: small integers, exact in every dtype."""
    base = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) % 5
    if dtype == torch.bool:
        return (base + rank) % 2 == 0
    return (base + rank + 1).to(dtype)


def expect_equal(got, want, what):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got, want), f"{what}: {got} != {want}"


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_allreduce(dtype):
    mine = value(R, dtype)
    contributions = [value(r, dtype).double() for r in range(N)]
    stacked = torch.stack(contributions)
    if dtype == torch.bool:
        cases = {hvd.Min: stacked.min(0).values, hvd.Max: stacked.max(0).values}
    else:
        cases = {hvd.Sum: stacked.sum(0), hvd.Min: stacked.min(0).values,
                 hvd.Max: stacked.max(0).values}
        if dtype.is_floating_point:
            cases[hvd.Average] = stacked.mean(0)
        if dtype in (torch.float32, torch.float64, torch.int64):
            cases[hvd.Product] = stacked.prod(0)
    for op, want in cases.items():
        want = want.to(dtype)
        got = hvd.allreduce(mine, op=op, name=f"ar.{dtype}.{op}")
        if op == hvd.Average:  # x/N summed: not exact for N = 3
            assert torch.allclose(got.double(), want.double(), atol=1e-2), (dtype, got)
        else:
            expect_equal(got, want, f"allreduce {dtype} op {op}")
        expect_equal(mine, value(R, dtype), "allreduce must not modify its input")
        # in place: the result lands in the tensor's own memory (zero copy)
        inplace = value(R, dtype)
        ptr = inplace.data_ptr()
        out = hvd.allreduce_(inplace, op=op, name=f"ar_.{dtype}.{op}")
        assert out is inplace and inplace.data_ptr() == ptr
        assert torch.allclose(inplace.double(), got.double(), atol=1e-2), (dtype, inplace)


def test_allreduce_defaults_scaling_and_shapes():
    """The default op is Average; prescale/postscale; deprecated average=; 0-d, empty and
    non-contiguous inputs to an out-of-place op."""
    got = hvd.allreduce(torch.full((4,), float(R)), prescale_factor=2.0, postscale_factor=3.0)
    assert torch.allclose(got, torch.full((4,), 6.0 * (N - 1) / 2)), got
    got = hvd.allreduce(torch.full((4,), float(R)), average=False)
    assert torch.allclose(got, torch.full((4,), float(N * (N - 1) / 2))), got
    expect_equal(hvd.allreduce(torch.tensor(float(R)), op=hvd.Sum),
                 torch.tensor(float(N * (N - 1) / 2)), "0-d allreduce")
    expect_equal(hvd.allreduce(torch.empty(0, 3), op=hvd.Sum), torch.empty(0, 3), "empty")
    strided = torch.arange(12.0).reshape(3, 4).t() + R
    expect_equal(hvd.allreduce(strided, op=hvd.Sum),
                 sum(torch.arange(12.0).reshape(3, 4).t() + r for r in range(N)),
                 "non-contiguous allreduce")


def test_async():
    handles = [hvd.allreduce_async(torch.full((3,), float(R + i)), op=hvd.Sum,
                                   name=f"async.{i}") for i in range(5)]
    inplace = torch.full((3,), float(R))
    handle_ = hvd.allreduce_async_(inplace, op=hvd.Max)
    for i, h in enumerate(handles):
        assert isinstance(h, int)
        out = hvd.synchronize(h)
        expect_equal(out, torch.full((3,), float(sum(r + i for r in range(N)))), "async")
    while not hvd.poll(handle_):
        pass
    assert hvd.synchronize(handle_) is inplace
    expect_equal(inplace, torch.full((3,), float(N - 1)), "async in place")


def test_grouped_allreduce():
    tensors = [value(R, torch.float32, (k + 1, 2)) for k in range(3)]
    want = [sum(value(r, torch.float32, (k + 1, 2)) for r in range(N)) for k in range(3)]
    for got, w in zip(hvd.grouped_allreduce(tensors, op=hvd.Sum), want):
        expect_equal(got, w, "grouped_allreduce")
    handle = hvd.grouped_allreduce_async(tensors, op=hvd.Sum, name="grouped")
    assert isinstance(handle, int)
    for got, w in zip(hvd.synchronize(handle), want):
        expect_equal(got, w, "grouped_allreduce_async")
    ptrs = [t.data_ptr() for t in tensors]
    outs = hvd.grouped_allreduce_(tensors, op=hvd.Sum)
    assert all(o is t and t.data_ptr() == p for o, t, p in zip(outs, tensors, ptrs))
    for got, w in zip(tensors, want):
        expect_equal(got, w, "grouped_allreduce_")
    handle = hvd.grouped_allreduce_async_([torch.ones(2) * R], op=hvd.Sum)
    expect_equal(hvd.synchronize(handle)[0], torch.ones(2) * (N * (N - 1) / 2),
                 "grouped_allreduce_async_")


def test_fp16_compression_gives_float32():
    got = hvd.allreduce(torch.full((3,), 0.5 + R), op=hvd.Sum, compression=hvd.Compression.fp16)
    expect_equal(got, torch.full((3,), sum(0.5 + r for r in range(N))), "fp16 compression")


def rows(rank, dtype):
    return value(rank, dtype, (rank + 1, 2))  # dim 0 differs per rank


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_allgather_and_broadcast(dtype):
    want = torch.cat([rows(r, dtype) for r in range(N)])
    expect_equal(hvd.allgather(rows(R, dtype)), want, f"allgather {dtype}")
    expect_equal(hvd.synchronize(hvd.allgather_async(rows(R, dtype))), want,
                 f"allgather_async {dtype}")
    for root in range(N):
        expect_equal(hvd.broadcast(value(R, dtype), root), value(root, dtype),
                     f"broadcast {dtype} root {root}")
        target = value(R, dtype)
        ptr = target.data_ptr()
        assert hvd.broadcast_(target, root) is target and target.data_ptr() == ptr
        expect_equal(target, value(root, dtype), f"broadcast_ {dtype}")


def test_grouped_allgather_and_async_broadcast():
    got = hvd.grouped_allgather([rows(R, torch.float32), torch.full((1,), float(R))])
    expect_equal(got[0], torch.cat([rows(r, torch.float32) for r in range(N)]), "grouped ag")
    expect_equal(got[1], torch.arange(N, dtype=torch.float32), "grouped allgather 2")
    got = hvd.synchronize(hvd.grouped_allgather_async([torch.tensor([R])]))
    expect_equal(got[0], torch.arange(N), "grouped_allgather_async")
    expect_equal(hvd.allgather(torch.tensor(float(R))), torch.arange(N, dtype=torch.float32),
                 "allgather of 0-d tensors")
    target = torch.full((2,), float(R))
    expect_equal(hvd.synchronize(hvd.broadcast_async_(target, N - 1)), target, "bcast handle")
    expect_equal(target, torch.full((2,), float(N - 1)), "broadcast_async_")
    expect_equal(hvd.synchronize(hvd.broadcast_async(torch.tensor([R]), 0)), torch.tensor([0]),
                 "broadcast_async")


@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_alltoall(dtype):
    # equal splits: rank R sends rows [j*2, j*2+2) to rank j
    mine = value(R, dtype, (2 * N, 3))
    want = torch.cat([value(r, dtype, (2 * N, 3))[2 * R:2 * R + 2] for r in range(N)])
    expect_equal(hvd.alltoall(mine), want, f"alltoall {dtype}")
    # uneven splits: rank R sends (j + R) % 3 rows to rank j
    splits = [(j + R) % 3 for j in range(N)]
    mine = value(R, dtype, (sum(splits), 2))
    out, received = hvd.alltoall(mine, splits=torch.tensor(splits, dtype=torch.int32))
    parts = []
    for r in range(N):
        theirs = [(j + r) % 3 for j in range(N)]
        start = sum(theirs[:R])
        parts.append(value(r, dtype, (sum(theirs), 2))[start:start + theirs[R]])
    expect_equal(out, torch.cat(parts), f"alltoall splits {dtype}")
    expect_equal(received, torch.tensor([(R + r) % 3 for r in range(N)], dtype=torch.int32),
                 "received splits")


def test_alltoall_async():
    out, received = hvd.synchronize(hvd.alltoall_async(torch.arange(N) + 10 * R))
    expect_equal(out, torch.arange(N) * 10 + R, "alltoall_async")
    expect_equal(received, torch.ones(N, dtype=torch.int32), "alltoall_async splits")


def uneven_rows():
    """A first dimension that does not divide by N (the first ranks get one more row), the rows
    of each rank, and where this rank's start."""
    d0 = 2 * N + 1
    counts = [d0 // N + (1 if r < d0 % N else 0) for r in range(N)]
    return d0, counts, sum(counts[:R])


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_reducescatter(dtype):
    d0, counts, start = uneven_rows()
    total = sum(value(r, dtype, (d0, 2)).double() for r in range(N))
    got = hvd.reducescatter(value(R, dtype, (d0, 2)), op=hvd.Sum)
    expect_equal(got, total[start:start + counts[R]].to(dtype), f"reducescatter {dtype}")


def test_reducescatter_average_grouped_and_async():
    d0, counts, start = uneven_rows()
    got = hvd.reducescatter(value(R, torch.float32, (d0, 2)))  # default op: Average
    want = sum(value(r, torch.float32, (d0, 2)) for r in range(N)) / N
    assert torch.allclose(got, want[start:start + counts[R]]), got
    got = hvd.grouped_reducescatter([torch.ones(N, 2) * (R + 1), torch.ones(N) * R], op=hvd.Sum)
    expect_equal(got[0], torch.ones(1, 2) * (N * (N + 1) / 2), "grouped_reducescatter")
    expect_equal(got[1], torch.ones(1) * (N * (N - 1) / 2), "grouped_reducescatter 2")
    handle = hvd.reducescatter_async(torch.ones(N, 1), op=hvd.Sum)
    expect_equal(hvd.synchronize(handle), torch.full((1, 1), float(N)), "reducescatter_async")
    handles = hvd.grouped_reducescatter_async([torch.ones(N, 1)], op=hvd.Sum)
    expect_equal(hvd.synchronize(handles)[0], torch.full((1, 1), float(N)), "grouped rs async")


@pytest.mark.parametrize("op_name", ["Average", "Sum"])
def test_sparse(op_name):
    op = getattr(hvd, op_name)
    scale = 1.0 / N if op == hvd.Average else 1.0
    dense_of = []
    for r in range(N):
        dense = torch.zeros(5, 3)
        dense[r % 5] = r + 1.0
        dense[4] = 1.0
        dense_of.append(dense)
    handle = hvd.sparse_allreduce_async(dense_of[R].to_sparse(), name=f"sparse.{op}", op=op)
    got = hvd.synchronize(handle)
    assert got.is_sparse
    expect_equal(got.to_dense(), sum(dense_of) * scale, f"sparse op {op}")


def test_allreduce_gradient():
    """The gradient of an allreduce is the same allreduce of the incoming gradient."""
    x = torch.full((3,), float(R + 1), requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum)
    (y * (R + 1)).sum().backward()
    expect_equal(x.grad, torch.full((3,), float(sum(r + 1 for r in range(N)))), "allreduce grad")
    x = torch.ones(2, requires_grad=True)
    hvd.allreduce(x).sum().backward()  # Average of ones
    expect_equal(x.grad, torch.ones(2), "averaged allreduce grad")


def test_grouped_allreduce_gradient():
    a, b = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    ya, yb = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    (ya.sum() + 2 * yb.sum()).backward()
    expect_equal(a.grad, torch.full((2,), float(N)), "grouped grad a")
    expect_equal(b.grad, torch.full((3,), 2.0 * N), "grouped grad b")


def test_allgather_gradient():
    """The averaged gradient sliced to this rank's rows (dim 0 differs per rank)."""
    x = torch.full((R + 1, 2), 1.0, requires_grad=True)
    y = hvd.allgather(x)
    weights = torch.arange(y.shape[0] * 2, dtype=torch.float32).reshape(-1, 2)
    (y * weights * (R + 1)).sum().backward()
    offset = sum(r + 1 for r in range(R))
    mean_scale = sum(r + 1 for r in range(N)) / N
    expect_equal(x.grad, weights[offset:offset + R + 1] * mean_scale, "allgather grad")
    xs = [torch.ones(R + 1, requires_grad=True), torch.ones(1, 2, requires_grad=True)]
    ys = hvd.grouped_allgather(xs)
    (ys[0].sum() + 3 * ys[1].sum()).backward()
    expect_equal(xs[0].grad, torch.ones(R + 1), "grouped allgather grad")
    expect_equal(xs[1].grad, torch.full((1, 2), 3.0), "grouped allgather grad 2")


def test_broadcast_gradient():
    """The averaged gradient on the root, zero elsewhere."""
    mean_scale = sum(r + 1 for r in range(N)) / N
    for root in range(N):
        x = torch.ones(3, requires_grad=True)
        (hvd.broadcast(x, root) * (R + 1)).sum().backward()
        want = torch.full((3,), mean_scale if R == root else 0.0)
        expect_equal(x.grad, want, f"broadcast grad root {root}")


def test_alltoall_gradient():
    """Gradients travel back to where the rows came from."""
    splits = [(j + R) % 3 for j in range(N)]
    x = torch.ones(sum(splits), 2, requires_grad=True)
    out, received = hvd.alltoall(x, splits=splits)
    assert not received.requires_grad
    (out * (R + 1)).sum().backward()
    want = torch.cat([torch.full((splits[j], 2), float(j + 1)) for j in range(N)])
    expect_equal(x.grad, want, "alltoall grad")


def test_reducescatter_gradient():
    """The allgather of the incoming gradients, times the size for Sum (Horovod's convention,
    as allreduce's gradient)."""
    x = torch.ones(N, 2, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Sum) * (R + 1)).sum().backward()
    want = torch.stack([torch.full((2,), float(r + 1)) for r in range(N)])
    expect_equal(x.grad, want * N, "reducescatter grad")
    x = torch.ones(N, 2, requires_grad=True)
    (hvd.reducescatter(x) * (R + 1)).sum().backward()  # Average
    expect_equal(x.grad, want, "averaged reducescatter grad")


def test_gradient_of_a_composite():
    """A numerical check: the gradient of sum(allreduce(x)**2)."""
    x = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(R))
    x.requires_grad_(True)
    (hvd.allreduce(x, op=hvd.Sum) ** 2).sum().backward()
    total = hvd.allreduce(x.detach(), op=hvd.Sum)
    assert torch.allclose(x.grad, 2 * N * total), (x.grad, total)


def test_process_set():
    if PAIR.included():
        got = hvd.allreduce(torch.tensor([float(R)]), op=hvd.Sum, process_set=PAIR)
        expect_equal(got, torch.tensor([2.0 * N - 3]), "process set allreduce")
        expect_equal(hvd.allgather(torch.tensor([R]), process_set=PAIR),
                     torch.tensor([N - 2, N - 1]), "process set allgather")
        # root ranks are global ranks, as in Horovod
        expect_equal(hvd.broadcast(torch.tensor([R]), N - 1, process_set=PAIR),
                     torch.tensor([N - 1]), "process set broadcast")
        x = torch.ones(2, requires_grad=True)
        hvd.broadcast(x, N - 1, process_set=PAIR).sum().backward()
        expect_equal(x.grad, torch.full((2,), 1.0 if R == N - 1 else 0.0), "set bcast grad")
    hvd.barrier()


@pytest.mark.parametrize("op", ["allreduce_", "allreduce_async_", "broadcast_"])
def test_non_contiguous_in_place_is_refused(op):
    args = (0,) if op == "broadcast_" else ()
    with pytest.raises(ValueError, match="contiguous"):
        getattr(hvd, op)(torch.ones(3, 4).t(), *args)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.float8_e4m3fn], ids=str)
def test_unsupported_dtype_is_refused(dtype):
    with pytest.raises(ValueError) as caught:
        hvd.allreduce(torch.zeros(2).to(dtype))
    assert "not supported" in str(caught.value) and "float32" in str(caught.value), caught.value


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        hvd.allreduce([1.0, 2.0])
    with pytest.raises(ValueError, match="handle"):
        hvd.synchronize(123456)
    with pytest.raises(ValueError, match="at least one tensor"):
        hvd.grouped_allreduce([])


def test_shape_mismatch_fails_on_every_rank():
    """A shape mismatch between ranks fails on every rank with Horovod's message."""
    with pytest.raises(hvd.HorovodInternalError) as caught:
        hvd.allreduce(torch.ones(R + 1), name="mismatch")
    assert "mismatched allreduce tensor shapes" in str(caught.value).lower(), caught.value


def test_join_barrier():
    # rank 0 has one more batch than the others: the others join early and contribute zeros
    if R == 0:
        got = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="join.extra")
        expect_equal(got, torch.ones(2), "allreduce while others joined")
    last = hvd.join()
    assert last == 0, last
    hvd.barrier()


