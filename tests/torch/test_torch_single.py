"""hpc_horovod.torch in one process (a job of size 1, no MPI): the tensor adapter's zero-copy
views, the API's shapes and errors, and the optimizer wrapper's checks."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from support import single_process_job, without_letting_go_of_the_gil  # noqa: E402

import hpc_horovod.torch as hvd  # noqa: E402
from hpc_horovod.common.types import bfloat16  # noqa: E402
from hpc_horovod.torch.adapter import engine_array, to_torch, write_back  # noqa: E402


@pytest.fixture
def single(monkeypatch):
    with single_process_job(hvd, monkeypatch) as job:
        yield job


# -- adapter --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.int64, torch.float16, torch.float32, torch.float64,
                                   torch.bool, torch.bfloat16])
def test_contiguous_cpu_tensors_are_viewed_not_copied(dtype):
    tensor = torch.arange(12).reshape(3, 4).to(dtype)
    array = engine_array(tensor, "allreduce", inplace=True)
    assert array.ctypes.data == tensor.data_ptr() and array.shape == (3, 4)
    back = to_torch(array, torch.device("cpu"))
    assert back.dtype == dtype and back.data_ptr() == tensor.data_ptr()
    assert torch.equal(back, tensor)


def test_bfloat16_keeps_its_bits_through_numpy():
    tensor = torch.tensor([1.5, -2.25, 3e38, float("inf")], dtype=torch.bfloat16)
    array = engine_array(tensor, "allreduce")
    assert array.dtype == bfloat16
    assert np.array_equal(array.astype(np.float32), tensor.float().numpy())
    assert torch.equal(to_torch(array.copy(), torch.device("cpu")), tensor)


def test_out_of_place_input_may_be_strided_in_place_may_not():
    strided = torch.arange(12.0).reshape(3, 4).t()
    array = engine_array(strided, "allreduce")
    assert array.flags.c_contiguous and np.array_equal(array, strided.numpy())
    with pytest.raises(ValueError, match="Tensor is required to be contiguous for the "
                                         "in-place allreduce_: call it on tensor.contiguous"):
        engine_array(strided, "allreduce_", inplace=True)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.uint32,
                                   torch.float8_e5m2])
def test_unsupported_dtypes_are_named_with_the_fix(dtype):
    with pytest.raises(ValueError, match=rf"Tensor type {dtype} is not supported by allreduce; "
                                         r"supported: .*bfloat16.*tensor.to\(torch.float32\)"):
        engine_array(torch.zeros(2).to(dtype), "allreduce")


def test_tensors_that_are_not_tensors_or_are_sparse_are_refused():
    with pytest.raises(TypeError, match="expects a torch.Tensor, got ndarray"):
        engine_array(np.zeros(2), "allgather")
    with pytest.raises(ValueError, match="sparse_allreduce_async"):
        engine_array(torch.eye(2).to_sparse(), "allreduce")


def test_write_back_copies_only_when_the_engine_wrote_elsewhere():
    target = torch.zeros(3)
    assert write_back(target.numpy(), target) is target
    result = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    assert write_back(result, target) is target and target.tolist() == [1.0, 2.0, 3.0]


# -- API in a job of size 1 -----------------------------------------------------------------------

def test_every_op_is_the_identity_and_returns_tensors(single):
    t = torch.arange(6.0).reshape(3, 2)
    for out in (hvd.allreduce(t), hvd.allgather(t), hvd.broadcast(t, 0), hvd.alltoall(t),
                hvd.reducescatter(t, op=hvd.Sum), hvd.grouped_allreduce([t])[0],
                hvd.grouped_allgather([t])[0], hvd.grouped_reducescatter([t], op=hvd.Sum)[0]):
        assert isinstance(out, torch.Tensor) and torch.equal(out, t)
    out, splits = hvd.alltoall(t, splits=[3])  # with splits: Horovod's (output, splits) pair
    assert torch.equal(out, t) and splits.tolist() == [3] and splits.dtype == torch.int32
    handle = hvd.alltoall_async(t)
    out, splits = hvd.synchronize(handle)
    assert torch.equal(out, t) and splits.tolist() == [3]
    assert hvd.allreduce_(t.clone(), op=hvd.Sum, postscale_factor=2.0).tolist() == \
        (t * 2).tolist()
    assert hvd.join() == 0
    hvd.barrier()


def test_handles_are_ints_polled_and_synchronized_once(single):
    handle = hvd.allreduce_async(torch.ones(2), name="h")
    assert isinstance(handle, int)
    while not hvd.poll(handle):
        pass
    assert hvd.synchronize(handle).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="already synchronized"):
        hvd.synchronize(handle)
    grouped = hvd.grouped_allreduce_async([torch.ones(1), torch.zeros(2)])
    assert isinstance(grouped, int)
    assert [t.tolist() for t in hvd.synchronize(grouped)] == [[1.0], [0.0, 0.0]]


def test_sparse_allreduce_keeps_a_sparse_tensor(single):
    dense = torch.zeros(4, 2)
    dense[1] = 3.0
    out = hvd.synchronize(hvd.sparse_allreduce_async(dense.to_sparse(), name="emb"))
    assert out.is_sparse and torch.equal(out.to_dense(), dense)
    with pytest.raises(ValueError, match="needs a sparse COO tensor"):
        hvd.sparse_allreduce_async(dense, name="dense")


def test_fp16_compression_round_trips_float_and_leaves_ints(single):
    x = torch.tensor([0.5, 1.25], dtype=torch.float64)
    compressed, ctx = hvd.Compression.fp16.compress(x)
    assert compressed.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(compressed, ctx).dtype == torch.float64
    ints = torch.tensor([1, 2])
    assert hvd.Compression.fp16.compress(ints)[0] is ints
    out = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float64 and out.tolist() == [0.5, 1.25]


def test_single_process_optimizer_is_the_plain_optimizer(single):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    assert isinstance(opt, torch.optim.Adam) and type(opt).__name__ == "Adam"
    x = torch.randn(4, 3)
    for o, m in ((opt, model), (ref_opt, ref)):
        for _ in range(3):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_optimizer_step_hooks_run_once(single):
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert calls == ["pre"]


def test_optimizer_keeps_the_state_and_defaults_it_wraps(single):
    model = torch.nn.Linear(2, 1)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    base.step()
    opt = hvd.DistributedOptimizer(base)
    assert opt.defaults["momentum"] == 0.9
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters())


@pytest.mark.parametrize("named, message", [
    (lambda m: [("w", m.weight), ("w", m.bias)],
     "Parameter names in named_parameters must be unique. Found duplicates: w"),
    (lambda m: [("w", m.weight)],
     "named_parameters was specified, but one or more model parameters were not named. "
     "Python object ids: "),
    (lambda m: [m.weight, m.bias],
     "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
     "model.named_parameters()."),
])
def test_optimizer_names_are_checked_with_horovods_texts(single, named, message):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError) as info:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=named(model))
    assert message in str(info.value)


def test_optimizer_argument_errors(single):
    model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != "
                                         "Average"):
        hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="groups should be a non-negative integer"):
        hvd.DistributedOptimizer(sgd, groups=-1)
    with pytest.raises(ValueError, match="A parameter can only appear once in groups"):
        hvd.DistributedOptimizer(sgd, groups=[[model.weight], [model.weight]])
    with pytest.warns(DeprecationWarning, match="num_groups"):
        hvd.DistributedOptimizer(sgd, num_groups=1)


def test_broadcast_optimizer_state_of_a_fresh_optimizer_changes_nothing(single):
    model = torch.nn.Linear(2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert not opt.state
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(ValueError, match="LBFGS"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0)
    with pytest.raises(ValueError, match="invalid params of type"):
        hvd.broadcast_parameters(3, root_rank=0)


def test_sync_batch_norm_alone_is_batch_norm(single):
    x = torch.randn(8, 3, 4)
    ref, sync = torch.nn.BatchNorm1d(3, momentum=None), hvd.SyncBatchNorm(3, momentum=None)
    for _ in range(2):
        assert torch.allclose(sync(x), ref(x))
    assert torch.allclose(sync.running_mean, ref.running_mean)
    assert torch.allclose(sync.running_var, ref.running_var)
    with pytest.raises(ValueError, match="expected at least 2D input"):
        sync(torch.ones(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_staged_through_the_host(single):
    t = torch.arange(4.0, device="cuda")
    assert hvd.allreduce(t).device == t.device
    assert hvd.allreduce_(t, op=hvd.Sum) is t and t.device.type == "cuda"
    assert hvd.allgather(t).device == t.device


SYNCHRONOUS = {
    "allreduce": lambda: hvd.allreduce(torch.ones(2)),
    "allreduce_": lambda: hvd.allreduce_(torch.ones(2)),
    "grouped_allreduce": lambda: hvd.grouped_allreduce([torch.ones(2), torch.ones(3)]),
    "grouped_allreduce_": lambda: hvd.grouped_allreduce_([torch.ones(2)]),
    "allgather": lambda: hvd.allgather(torch.ones(2)),
    "grouped_allgather": lambda: hvd.grouped_allgather([torch.ones(2)]),
    "broadcast": lambda: hvd.broadcast(torch.ones(2), 0),
    "broadcast_": lambda: hvd.broadcast_(torch.ones(2), 0),
    "alltoall": lambda: hvd.alltoall(torch.ones(2)),
    "reducescatter": lambda: hvd.reducescatter(torch.ones(2)),
    "grouped_reducescatter": lambda: hvd.grouped_reducescatter([torch.ones(2)]),
    "broadcast_parameters": lambda: hvd.broadcast_parameters({"w": torch.ones(2)}, 0),
    "barrier": hvd.barrier,
}


@pytest.mark.parametrize("call", SYNCHRONOUS.values(), ids=SYNCHRONOUS.keys())
def test_synchronous_ops_run_their_own_cycles(leaves_engine_asleep, call):
    """They wait for what they submit, so they leave the engine thread asleep."""
    leaves_engine_asleep(call, lambda: hvd.allreduce_async(torch.ones(2)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_engine_views_never_let_go_of_the_gil(dtype):
    """A submission that releases the GIL lets the engine thread run a cycle in the middle of a
    batch of gradients (bfloat16's did, through ``tensor.view(torch.int16)``)."""
    tensors = [torch.ones(64, dtype=dtype) for _ in range(100)]
    engine_array(tensors[0], "allreduce")  # first calls may initialize things, GIL released
    views = without_letting_go_of_the_gil(
        lambda: [engine_array(t, "allreduce") for t in tensors])
    expected = bfloat16 if dtype == torch.bfloat16 else np.dtype(str(dtype).split(".")[1])
    assert all(v.dtype == expected and v.ctypes.data == t.data_ptr()
               for v, t in zip(views, tensors))


# -- the per-tensor async ops: one Python path ----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.int64, torch.float16, torch.bfloat16, torch.float32,
                                   torch.float64])
def test_async_allreduce_in_and_out_of_place(single, dtype):
    from hpc_horovod.torch import mpi_ops

    values = torch.arange(1, 13, dtype=torch.float32).reshape(3, 4).to(dtype)
    tensor = values.clone()
    out = hvd.synchronize(hvd.allreduce_async(tensor, name="out", op=hvd.Sum,
                                              prescale_factor=2.0))
    assert out is not tensor and torch.equal(tensor, values)
    assert out.dtype == dtype and torch.equal(out, values * 2)
    handle = hvd.allreduce_async_(tensor, name="in", op=hvd.Sum, prescale_factor=2.0)
    while not hvd.poll(handle):
        pass
    assert hvd.synchronize(handle) is tensor and torch.equal(tensor, values * 2)
    assert mpi_ops._handle_map == {}


VIEWS = {
    "slice view": lambda: torch.arange(6.0)[2:],
    "transposed": lambda: torch.arange(6.0).reshape(2, 3).t(),
    "empty": lambda: torch.ones(0),
    "0-d": lambda: torch.tensor(3.0),
    "requires grad": lambda: torch.ones(3, requires_grad=True),
    "parameter": lambda: torch.nn.Parameter(torch.ones(2)),
}


@pytest.mark.parametrize("make", VIEWS.values(), ids=VIEWS.keys())
def test_views_and_leaves_reduce_to_their_values(single, make):
    tensor = make()
    out = hvd.synchronize(hvd.allreduce_async(tensor, name="view", op=hvd.Sum))
    assert out.shape == tensor.shape and torch.equal(out, tensor.detach())


def test_what_the_engine_cannot_take_is_refused(single):
    with pytest.raises(RuntimeError, match="negative bit"):  # never read as its memory
        hvd.allreduce_async(torch._neg_view(torch.arange(1.0, 4.0)), name="neg")
    with pytest.raises(ValueError, match="not supported"):
        hvd.allreduce_async(torch.ones(2, dtype=torch.complex64), name="complex")
    with pytest.raises(TypeError, match="expects a torch.Tensor, got ndarray"):
        hvd.allreduce_async(np.ones(2, dtype=np.float32), name="numpy")
    with pytest.raises(ValueError, match="contiguous"):
        hvd.allreduce_async_(torch.arange(6.0).reshape(2, 3).t(), name="strided")
    from hpc_horovod.torch import mpi_ops

    assert mpi_ops._handle_map == {}


@pytest.mark.parametrize("name", ["allreduce_async", "allreduce_async_"])
def test_submissions_never_let_go_of_the_gil(single, name):
    """A submission that releases the GIL lets the engine thread run a cycle in the middle of a
    step's gradients."""
    submit = getattr(hvd, name)
    tensors = [torch.ones(64) for _ in range(100)]
    hvd.synchronize(submit(torch.ones(64), name="warm-up", op=hvd.Sum))
    handles = without_letting_go_of_the_gil(
        lambda: [submit(t, name=f"gil.{i}", op=hvd.Sum) for i, t in enumerate(tensors)])
    for handle in handles:
        hvd.synchronize(handle)


def test_buckets_split_by_kind_and_size_with_a_smaller_first_bucket():
    from hpc_horovod.torch.optimizer import _by_kind

    f32 = [torch.zeros(256) for _ in range(6)]  # 1 KiB each
    f64 = [torch.zeros(128, dtype=torch.float64) for _ in range(2)]
    params = [f32[0], f64[0], *f32[1:4], f64[1], *f32[4:]]
    buckets = _by_kind(params, cap=3072, first_cap=1024)
    ids = [[id(p) for p in b] for b in buckets]
    assert ids == [[id(f32[0])], [id(f64[0])], [id(p) for p in f32[1:4]],
                   [id(f64[1])], [id(p) for p in f32[4:]]]
    # no cap: one bucket per dtype, in order
    assert [len(b) for b in _by_kind(params, float("inf"), float("inf"))] == [6, 2]
