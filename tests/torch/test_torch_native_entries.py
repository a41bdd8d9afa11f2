"""hpc_horovod.torch's ``allreduce_async``, ``allreduce_async_`` and ``synchronize`` with their
common case in C (``_native.Entry`` with a tensor type, src_native/entry.c and torch_view.c):
a contiguous CPU tensor goes to the engine as a view of its memory, and its result comes back
without Python frames. In one process (a job of size 1, no MPI) they must give what the
Python functions behind them (``__wrapped__``) give, and leave them everything else.
"""

from __future__ import annotations

import inspect
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
_native = pytest.importorskip("hpc_horovod._native")

from support import single_process_job, without_letting_go_of_the_gil  # noqa: E402

import hpc_horovod.torch as hvd  # noqa: E402
from hpc_horovod.torch import mpi_ops  # noqa: E402

pytestmark = pytest.mark.timeout(60)
ENTRIES = ["allreduce_async", "allreduce_async_", "synchronize"]
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]


@pytest.fixture
def single(monkeypatch):
    with single_process_job(hvd, monkeypatch) as job:
        yield job


def python(name: str):
    return getattr(mpi_ops, name).__wrapped__


@pytest.mark.parametrize("name", ENTRIES)
def test_entries_stand_in_front_of_the_python_functions(name):
    entry = getattr(hvd, name)
    assert isinstance(entry, _native.Entry) and entry is getattr(mpi_ops, name)
    assert inspect.isfunction(entry.__wrapped__)
    assert (entry.__name__, entry.__doc__) == (python(name).__name__, python(name).__doc__)
    assert inspect.signature(entry) == inspect.signature(python(name))


@pytest.mark.usefixtures("single")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_tensors_give_the_python_results(dtype):
    values = torch.arange(1, 13, dtype=torch.float32).reshape(3, 4).to(dtype)
    for in_place in (False, True):
        name = "allreduce_async_" if in_place else "allreduce_async"
        results = []
        for way, fn in (("c", getattr(hvd, name)), ("python", python(name))):
            tensor = values.clone()
            handle = fn(tensor, name=f"{way}.{in_place}", op=hvd.Sum, prescale_factor=2.0)
            out = (hvd.synchronize if way == "c" else python("synchronize"))(handle)
            assert out.dtype == dtype and out.shape == values.shape
            if in_place:
                assert out is tensor
            else:
                assert out is not tensor and torch.equal(tensor, values)
            results.append(out)
        assert torch.equal(results[0], results[1]) and torch.equal(results[0], values * 2)
    assert mpi_ops._handle_map == {}


@pytest.mark.usefixtures("single")
def test_the_c_path_registers_its_handles_like_the_python_one():
    tensor = torch.ones(5)
    handle = hvd.allreduce_async_(tensor, name="registered", op=hvd.Sum)
    finish = mpi_ops._handle_map[handle]  # one engine request: its handle is the torch handle
    assert isinstance(finish, _native.TorchResult)
    assert mpi_ops._entry(handle) == ([handle], finish)
    while not hvd.poll(handle):
        time.sleep(0.001)
    assert hvd.synchronize(handle) is tensor
    with pytest.raises(ValueError, match="already synchronized"):
        hvd.synchronize(handle)


@pytest.mark.usefixtures("single")
def test_a_result_in_other_memory_is_written_back_or_wrapped():
    """The finishing step's fallbacks: ``write_back`` copies a result the engine wrote
    elsewhere into the tensor; out of place, ``to_torch`` wraps it."""
    tensor = torch.zeros(4)
    handle = hvd.allreduce_async_(tensor, name="elsewhere", op=hvd.Sum)
    finish = mpi_ops._handle_map[handle]
    hvd.synchronize(handle)
    assert finish([np.arange(4, dtype=np.float32)]) is tensor
    assert torch.equal(tensor, torch.arange(4, dtype=torch.float32))
    handle = hvd.allreduce_async(tensor, name="wrapped", op=hvd.Sum)
    finish = mpi_ops._handle_map[handle]
    hvd.synchronize(handle)
    wrapped = finish([np.full(2, 7, dtype=np.float64)])
    assert isinstance(wrapped, torch.Tensor) and torch.equal(wrapped, torch.full((2,), 7.0,
                                                                                 dtype=torch.float64))


def _outcome(fn, make):
    try:
        out = hvd.synchronize(fn(make(), name="declined", op=hvd.Sum))
    except Exception as exc:  # noqa: BLE001 - the same error either way is the point
        return type(exc), str(exc)
    return out.dtype, out.shape, out.tolist()


DECLINED = {
    "slice view": lambda: torch.arange(6.0)[2:],
    "negative view": lambda: torch._neg_view(torch.arange(3.0)),
    "conjugate's imaginary part": lambda: torch.tensor([1 + 2j]).conj().imag,
    "transposed": lambda: torch.arange(6.0).reshape(2, 3).t(),
    "empty": lambda: torch.ones(0),
    "0-d": lambda: torch.tensor(3.0),
    "requires grad": lambda: torch.ones(3, requires_grad=True),
    "parameter": lambda: torch.nn.Parameter(torch.ones(2)),
    "complex": lambda: torch.ones(2, dtype=torch.complex64),
    "sparse": lambda: torch.ones(2).to_sparse(),
    "numpy array": lambda: np.ones(2, dtype=np.float32),
}


@pytest.mark.usefixtures("single")
@pytest.mark.parametrize("make", DECLINED.values(), ids=DECLINED.keys())
@pytest.mark.parametrize("name", ["allreduce_async", "allreduce_async_"])
def test_what_the_c_path_declines_ends_as_in_python(name, make):
    """Views (a negative one holds the values of the other sign), other layouts, dtypes and
    types: the same result or the same error as the Python function."""
    assert _outcome(getattr(hvd, name), make) == _outcome(python(name), make)
    assert mpi_ops._handle_map == {}


@pytest.mark.usefixtures("single")
def test_a_negative_view_is_never_read_as_its_memory():
    tensor = torch._neg_view(torch.arange(1.0, 4.0))
    with pytest.raises(RuntimeError, match="negative bit"):
        hvd.synchronize(hvd.allreduce_async(tensor, name="neg", op=hvd.Sum))


@pytest.mark.usefixtures("single")
@pytest.mark.parametrize("name", ["allreduce_async", "allreduce_async_"])
def test_submissions_never_let_go_of_the_gil(name):
    """A submission that releases the GIL lets the engine thread run a cycle in the middle of a
    step's gradients (``tensor.is_neg()`` does: a cycle every few gradients, both ranks out of
    step, twice the time for 200 x 16 KiB)."""
    submit = getattr(hvd, name)
    tensors = [torch.ones(64) for _ in range(100)]
    hvd.synchronize(submit(torch.ones(64), name="warm-up", op=hvd.Sum))
    handles = without_letting_go_of_the_gil(
        lambda: [submit(t, name=f"gil.{i}", op=hvd.Sum) for i, t in enumerate(tensors)])
    for handle in handles:
        hvd.synchronize(handle)


@pytest.mark.usefixtures("single")
@pytest.mark.filterwarnings("ignore:Parameter `average` has been replaced")
@pytest.mark.parametrize("kwargs", [{}, {"average": False}, {"prescale_factor": 2},
                                    {"name": "positional"}])
def test_arguments_the_lane_does_not_take_run_the_python_function(kwargs):
    """No name (a generated one), ``average=``, an int scale: the Python function's result."""
    tensor = torch.arange(4.0)
    if kwargs.get("name"):
        handle = hvd.allreduce_async(tensor, None, kwargs["name"], hvd.Sum)
    else:
        handle = hvd.allreduce_async(tensor, **kwargs)
    expected = tensor * (2 if "prescale_factor" in kwargs else 1)
    assert torch.equal(hvd.synchronize(handle), expected)
    assert mpi_ops._handle_map == {}
