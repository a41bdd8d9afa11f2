"""The public functions with their common case in C (``_native.Entry``, src_native/entry.c):
``hvd.allreduce_async``, ``hvd.allreduce_async_`` and ``hvd.synchronize`` must look and behave
exactly like the Python functions they stand in front of (``__wrapped__``), in one process.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import hpc_horovod as hvd
from hpc_horovod.common import basics, ops

_native = pytest.importorskip("hpc_horovod._native")
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:Parameter `average` has been replaced")]

ENTRIES = ["allreduce_async", "allreduce_async_", "synchronize"]


@pytest.fixture
def initialized():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.mark.parametrize("name", ENTRIES)
def test_entries_look_like_their_python_functions(name):
    entry = getattr(hvd, name)
    python = entry.__wrapped__
    assert isinstance(entry, _native.Entry) and inspect.isfunction(python)
    assert entry is getattr(ops, name)
    assert (entry.__name__, entry.__doc__, entry.__module__) == (
        python.__name__, python.__doc__, python.__module__)
    assert inspect.signature(entry) == inspect.signature(python)
    assert repr(entry) == repr(python)


def test_before_init_the_python_function_raises():
    with pytest.raises(ValueError, match="has not been initialized"):
        hvd.allreduce_async_(np.ones(3), name="x")
    with pytest.raises(ValueError, match="has not been initialized"):
        hvd.synchronize(1)


@pytest.mark.usefixtures("initialized")
@pytest.mark.parametrize("call", [
    lambda x: hvd.allreduce_async_(x, name="kw", op=hvd.Sum),
    lambda x: hvd.allreduce_async_(x, None, "positional", hvd.Sum, 1.0, 1.0,
                                   hvd.global_process_set),
    lambda x: hvd.allreduce_async_(x, op=hvd.Sum),  # a generated name: the Python path
    lambda x: hvd.allreduce_async_(x, name="avg", average=False),  # the Python path
    lambda x: hvd.allreduce_async_(x, name="scaled", op=hvd.Sum, prescale_factor=2,
                                   postscale_factor=0.5),  # int scale: the Python path
    lambda x: hvd.allreduce_async_(tensor=x, name="all keywords", op=hvd.Sum),
])
def test_in_place_submissions_give_the_python_results(call):
    x = np.arange(5, dtype=np.float32)
    handle = call(x)
    assert isinstance(handle, int)
    assert hvd.synchronize(handle) is x and np.array_equal(x, np.arange(5))


@pytest.mark.usefixtures("initialized")
def test_out_of_place_submissions_and_what_is_not_a_numpy_array():
    x = np.arange(4.0)
    got = hvd.synchronize(hvd.allreduce_async(x, name="out"))
    assert got is not x and np.array_equal(got, x)
    listed = hvd.synchronize(hvd.allreduce_async([1.0, 2.0], name="list", op=hvd.Sum))
    assert np.array_equal(listed, [1.0, 2.0])
    strided = np.arange(8.0)[::2]
    assert np.array_equal(hvd.synchronize(hvd.allreduce_async(strided, name="strided")),
                          strided)


@pytest.mark.usefixtures("initialized")
def test_errors_are_the_python_functions_errors():
    x = np.ones(3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        hvd.allreduce_async(x, name="b", bogus=1)
    with pytest.raises(TypeError, match="multiple values for argument 'name'"):
        hvd.allreduce_async(x, None, "a", name="b")
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        hvd.allreduce_async_()
    with pytest.raises(ValueError, match="writable C-contiguous"):
        hvd.allreduce_async_(np.arange(8.0)[::2], name="strided in place")
    readonly = np.ones(3)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writable C-contiguous"):
        hvd.allreduce_async_(readonly, name="read-only")
    handle = hvd.allreduce_async_(x, name="twice")
    with pytest.raises(ValueError, match="twice"):
        hvd.allreduce_async_(np.ones(3), name="twice")
    hvd.synchronize(handle)
    with pytest.raises(ValueError, match="was not created or has been cleared"):
        hvd.synchronize(handle)
    with pytest.raises(TypeError):
        hvd.synchronize()


@pytest.mark.usefixtures("initialized")
def test_the_lane_takes_numpy_arrays_and_the_python_function_the_rest():
    """The common case never reaches the Python function; the rest always does."""
    calls = []

    def recording(python):
        def fallback(*args, **kwargs):
            calls.append(kwargs)
            return python(*args, **kwargs)
        return fallback

    entries = {name: _native.Entry(name, recording(getattr(ops, name).__wrapped__),
                                   vars(basics), process_set=hvd.global_process_set)
               for name in ("allreduce_async", "allreduce_async_")}
    synchronize = _native.Entry("synchronize", recording(ops.synchronize.__wrapped__),
                                vars(basics))
    x = np.ones(3, np.float32)
    assert synchronize(entries["allreduce_async_"](x, name="fast", op=hvd.Sum)) is x
    assert np.array_equal(synchronize(entries["allreduce_async"](x, name="fast.out")), x)
    assert calls == []
    handle = entries["allreduce_async"](x, name="slow", average=True)
    assert calls == [{"name": "slow", "average": True}]
    assert np.array_equal(synchronize(handle), x) and len(calls) == 1
    handle = entries["allreduce_async"](x, name="kw")
    assert np.array_equal(synchronize(handle=handle), x)  # a keyword: the Python function
    assert calls[1:] == [{"handle": handle}]


def test_entries_are_made_for_the_three_functions_only():
    with pytest.raises(ValueError, match="no entry allgather"):
        _native.Entry("allgather", print, {})
    with pytest.raises(TypeError, match="must be callable"):
        _native.Entry("synchronize", None, {})
    with pytest.raises(TypeError):
        _native.Entry("synchronize", print, None)  # the namespace is a dict
