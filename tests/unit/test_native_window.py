"""The node's shared window as a C object (``_native.Window``, src_native/window_object.c) and
the engine's way of handing it whole groups of requests (``Lane.sum_in_window``,
``Engine._sum_in_window``), in one process: a window of one rank sums alone, and one that
waits for a second rank that never comes times out. Sums across real ranks, the slots shared
with the staged reductions and skewed arrivals are checked in tests/parallel
(node_allreduce_worker.py, peer_allreduce_worker.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hpc_horovod.backends.single import SingleBackend
from hpc_horovod.common import engine as engine_mod
from hpc_horovod.common import fusion
from hpc_horovod.common.config import Settings
from hpc_horovod.common.errors import HorovodInternalError
from hpc_horovod.common.request import Request, signature_of
from hpc_horovod.common.types import Average, Max, Sum

_native = pytest.importorskip("hpc_horovod._native")
pytestmark = pytest.mark.timeout(60)

SLOTS, FLAG_STRIDE = 2, 8


def make_window(capacity: int = 1 << 16, size: int = 1, rank: int = 0):
    """A Window over private memory: with one rank nobody else has to map it."""
    memory = np.zeros(SLOTS * (size + 1) * capacity, np.uint8)
    flags = np.zeros(size * FLAG_STRIDE, np.int64)
    return _native.Window(memory, flags, rank, size, SLOTS), memory, flags


def table_of(inputs, outputs) -> np.ndarray:
    table = np.empty((len(inputs), 3), np.uint64)
    _native.peer_table(inputs, outputs, table)
    return table


def test_a_window_of_one_rank_sums_its_own_tensors_times_the_factor():
    window, _, _ = make_window()
    assert window.capacity == 1 << 16 and window.slots == SLOTS
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
        xs = [rng.standard_normal(n).astype(dtype) for n in (1, 17, 1000)]
        outputs = [np.full_like(x, np.nan) for x in xs]
        window.sum(table_of(xs, outputs), np.dtype(dtype).name, 0.5, 0.0, 0.0)
        for x, out in zip(xs, outputs):
            wide = np.float32 if x.itemsize == 2 else x.dtype.type  # halves: summed in float32
            want = (x.astype(wide) * wide(0.5)).astype(dtype)
            assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), dtype
    assert (window.sums, window.tensors) == (4, 12)


def test_native_sums_and_staged_reductions_share_the_slot_counter():
    window, _, _ = make_window()
    x = np.ones(8, np.float32)
    assert [window.take_slot(), window.take_slot()] == [0, 1]
    window.sum(table_of([x], [x]), "float32", 1.0, 0.0, 0.0)  # took slot 0
    assert window.take_slot() == 1


def test_bad_windows_and_groups_are_refused_before_anything_runs():
    memory, flags = np.zeros(1001, np.uint8), np.zeros(8, np.int64)
    with pytest.raises(ValueError, match="rank 0 of 1, 2 slots in 1001 bytes"):
        _native.Window(memory, flags, 0, 1, SLOTS)  # not 2 x 2 segments
    with pytest.raises(ValueError, match="rank 2 of 2"):
        _native.Window(np.zeros(1200, np.uint8), np.zeros(16, np.int64), 2, 2, SLOTS)
    with pytest.raises(ValueError, match="bytes of flags"):
        _native.Window(np.zeros(1200, np.uint8), np.zeros(8, np.int64), 0, 2, SLOTS)
    window, _, _ = make_window(capacity=64)
    x = np.ones(17, np.float32)
    with pytest.raises(ValueError, match="a group of 68 bytes is more than the 64 bytes"):
        window.sum(table_of([x], [x]), "float32", 1.0, 0.0, 0.0)
    with pytest.raises(TypeError, match="no sum of int32"):
        window.sum(table_of([x], [x]), "int32", 1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="not rows of 3"):
        window.sum(np.zeros(4, np.uint64), "float32", 1.0, 0.0, 0.0)
    assert window.sums == 0 and np.all(x == 1)
    window.close()
    window.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        window.sum(table_of([x], [x]), "float32", 1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="closed"):
        window.take_slot()


def test_a_peer_that_never_comes_times_out_naming_it():
    window, _, _ = make_window(size=2)
    x = np.ones(64, np.float32)
    with pytest.raises(TimeoutError, match=r"rank\(s\) 1 did not write their part of the group "
                                           r"within 0.2 s"):
        window.sum(table_of([x], [x]), "float32", 1.0, 0.2, 0.0)
    assert window.sums == 0


# -- Lane.sum_in_window ---------------------------------------------------------------------------

@pytest.fixture
def engine():
    eng = engine_mod.Engine(SingleBackend(), Settings())  # thread never started
    assert eng.lane is not None
    return eng


def claimed(eng, name: str, tensor, output, op=Sum) -> Request:
    """A request as the engine holds it once submitted: in flight under its name."""
    req = Request(name, tensor, signature_of("allreduce", tensor, op), 0, output)
    eng._inflight[req.key] = req
    return req


def refuse_fresh():
    raise AssertionError("a fresh buffer although every request has an output")


def test_a_group_is_summed_from_its_requests_and_completed(engine):
    window, _, _ = make_window()
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(n).astype(np.float32) for n in (5, 300, 64)]
    fills = [x.copy() for x in xs]
    outputs = [xs[0], np.zeros_like(xs[1]), xs[2]]  # in place, out of place, in place
    reqs = [claimed(engine, f"g{i}", x, out) for i, (x, out) in enumerate(zip(xs, outputs))]
    group = [None] + reqs + [None]  # the slice is what counts
    assert engine.lane.sum_in_window(window, group, 1, 4, "float32", 3.0, 0.0, 0.0,
                                     refuse_fresh) is True
    for fill, out, req in zip(fills, outputs, reqs):
        assert np.array_equal(out, fill * np.float32(3.0))
        assert req.done and req.error is None and req.result is req.output
    assert np.array_equal(xs[1], fills[1]), "an out-of-place input is left as it was"
    assert not engine._inflight and (window.sums, window.tensors) == (1, 3)


def test_results_without_an_output_are_views_of_one_fresh_buffer_shaped_as_their_tensors(engine):
    window, _, _ = make_window()
    xs = [np.arange(6, dtype=np.float32).reshape(2, 3), np.full(5, 2.0, np.float32),
          np.array(7.0, np.float32), np.ones((4, 1), np.float32)]
    reqs = [claimed(engine, f"o{i}", x, None if i != 1 else x) for i, x in enumerate(xs)]
    fresh, made = np.full(6 + 5 + 1 + 4, np.nan, np.float32), []
    assert engine.lane.sum_in_window(window, reqs, 0, 4, "float32", 0.5, 0.0, 0.0,
                                     lambda: made.append(1) or fresh) is True
    assert made == [1], "one buffer for the group"
    for i, (x, req) in enumerate(zip(xs, reqs)):
        assert req.done and req.result.shape == x.shape and req.result.dtype == x.dtype
        if i == 1:
            assert req.result is x and np.all(x == 1.0), "in place"
        else:
            assert np.array_equal(req.result, np.arange(x.size).reshape(x.shape) * 0.5 if i == 0
                                  else x * np.float32(0.5))
            assert req.result.base is fresh and req.result.flags.writeable
    assert np.array_equal(xs[0], np.arange(6).reshape(2, 3)), "inputs left as they were"
    offsets = [r.result.__array_interface__["data"][0] - fresh.ctypes.data
               for r in reqs if r.result.base is fresh]
    assert offsets == [0, 44, 48], "laid end to end in the group's order"
    assert not engine._inflight


def test_a_fresh_buffer_that_cannot_hold_the_group_is_an_error(engine):
    window, _, _ = make_window()
    x = np.ones(8, np.float32)
    reqs = [claimed(engine, "a", x, None)]
    for bad in (np.empty(7, np.float32), np.empty(16, np.float32)[::2], [0.0] * 8):
        with pytest.raises(ValueError, match="writable C-contiguous numpy array of at least 32"):
            engine.lane.sum_in_window(window, reqs, 0, 1, "float32", 1.0, 0.0, 0.0,
                                      lambda bad=bad: bad)
    with pytest.raises(ZeroDivisionError):
        engine.lane.sum_in_window(window, reqs, 0, 1, "float32", 1.0, 0.0, 0.0, lambda: 1 / 0)
    assert not reqs[0].done and window.sums == 0


@pytest.mark.parametrize("case", ["joined", "read-only output", "strided output",
                                  "strided input", "smaller output", "not an array",
                                  "python request"])
def test_a_group_the_window_cannot_take_as_it_is_is_declined_untouched(engine, case):
    window, _, _ = make_window()
    x = np.arange(8, dtype=np.float32)
    good = claimed(engine, "good", x.copy(), None)
    good.output = good.tensor
    odd_output = {
        "read-only output": np.zeros(8, np.float32),
        "strided output": np.zeros(16, np.float32)[::2],
        "smaller output": np.zeros(7, np.float32),
        "not an array": bytearray(32),
    }
    if case == "joined":
        odd = None
    elif case == "python request":  # same fields, another type

        class PythonRequest:
            tensor = output = x
        odd = PythonRequest()
    elif case == "strided input":
        odd = claimed(engine, "odd", np.zeros(16, np.float32)[::2], None)
    else:
        odd = claimed(engine, "odd", x.copy(), odd_output[case])
        if case == "read-only output":
            odd.output.flags.writeable = False
    group = [good, odd]
    assert engine.lane.sum_in_window(window, group, 0, 2, "float32", 2.0, 0.0, 0.0,
                                     refuse_fresh) is False
    assert np.array_equal(good.tensor, x) and not good.done
    assert good.key in engine._inflight and window.sums == 0
    if hasattr(odd, "done"):
        assert not odd.done


def test_bad_arguments_raise(engine):
    window, _, _ = make_window()
    x = np.ones(4, np.float32)
    group = [claimed(engine, "a", x, x)]
    with pytest.raises(IndexError, match=r"\[0, 2\) of a group of 1"):
        engine.lane.sum_in_window(window, group, 0, 2, "float32", 1.0, 0.0, 0.0, None)
    with pytest.raises(TypeError, match="no sum of int8"):
        engine.lane.sum_in_window(window, group, 0, 1, "int8", 1.0, 0.0, 0.0, None)
    with pytest.raises(TypeError, match="expected a hpc_horovod._native.Window"):
        engine.lane.sum_in_window(object(), group, 0, 1, "float32", 1.0, 0.0, 0.0, None)
    with pytest.raises(TypeError, match="Lane.sum_in_window"):
        engine.lane.sum_in_window(window, tuple(group), 0, 1, "float32", 1.0, 0.0, 0.0, None)
    with pytest.raises(TypeError, match="Lane.sum_in_window"):
        engine.lane.sum_in_window(window, group, 0, 1, "float32", 1.0, 0.0, 0.0)
    window.close()
    with pytest.raises(ValueError, match="closed"):
        engine.lane.sum_in_window(window, group, 0, 1, "float32", 1.0, 0.0, 0.0, None)
    assert not group[0].done and np.all(x == 1)


def test_the_engine_names_the_group_and_the_missing_rank_when_a_peer_never_comes():
    engine = engine_mod.Engine(SingleBackend(), Settings(peer_timeout_s=0.2))
    window, _, _ = make_window(size=2)
    xs = [np.ones(16, np.float32) for _ in range(3)]
    reqs = [claimed(engine, f"t{i}", x, x) for i, x in enumerate(xs)]
    with pytest.raises(HorovodInternalError) as info:
        engine._sum_in_window(window, reqs, 0, 3, ("float32", 1.0, refuse_fresh))
    text = str(info.value)
    assert text.startswith("shared-memory allreduce of 3 tensors of float32: rank(s) 1 did not "
                           "write their part of the group within 0.2 s"), text
    assert "HOROVOD_PEER_TIMEOUT_SECONDS" in text
    # still in flight: the engine stops on this error and fails them with it
    assert all(req.key in engine._inflight and not req.done for req in reqs)


# -- which groups go to the window whole ----------------------------------------------------------

class _WindowBackend:
    """What FusedAllreduce.window_sum asks a backend (the real answers come from MpiBackend,
    checked over MPI processes in tests/parallel)."""

    size = 2
    fusion_capacity = 16 << 20

    def __init__(self):
        self.asked = 0

    def sums_in_window(self, dtype) -> bool:
        self.asked += 1
        return dtype.name in ("float32", "float64", "float16", "bfloat16")

    def reduces_through_peers(self, dtype) -> bool:
        raise AssertionError("window_sum must leave the peers' memory to __call__")

    def sum_in_window(self, *args) -> None: ...

    def reduce_through_peers(self, *args) -> None: ...


def fused_of(*arrays, op=Sum, prescale=1.0, postscale=1.0) -> fusion.FusedAllreduce:
    return fusion.FusedAllreduce([signature_of("allreduce", a, op, prescale=prescale,
                                               postscale=postscale) for a in arrays])


def test_float_sums_go_whole_to_the_window_with_their_factor_decided_once_per_window():
    backend, window = _WindowBackend(), object()
    small = np.zeros(1024, np.float32)
    fused = fused_of(small, small, op=Average, prescale=3.0)
    how = fused.window_sum(backend, window)
    assert how[:2] == ("float32", 1.5)  # 3 x 1/2 ranks
    assert fused.window_sum(backend, window) is how and backend.asked == 1
    assert fused.window_sum(backend, object())[:2] == ("float32", 1.5) and backend.asked == 2
    fresh = how[2]()  # the group's buffer for results without an output
    assert fresh.shape == (2048,) and fresh.dtype == np.float32
    half = small.astype(ml_dtypes.bfloat16)
    how = fused_of(half, half).window_sum(backend, window)
    assert how[:2] == ("bfloat16", 1.0) and how[2]().dtype == ml_dtypes.bfloat16
    alone = np.zeros(fusion.WINDOW_MIN_BYTES // 4, np.float32)
    assert fused_of(alone).window_sum(backend, window)[:2] == ("float32", 1.0)


@pytest.mark.parametrize("case", ["max", "int32", "postscaled int", "small alone",
                                  "large alone"])
def test_other_groups_are_left_to_the_python_path(case):
    backend, window = _WindowBackend(), object()
    f32 = np.zeros(1024, np.float32)
    fused = {
        "max": lambda: fused_of(f32, f32, op=Max),
        "int32": lambda: fused_of(f32.astype(np.int32), f32.astype(np.int32)),
        "postscaled int": lambda: fused_of(np.zeros(9, np.int64), np.zeros(9, np.int64),
                                           postscale=2.0),
        "small alone": lambda: fused_of(np.zeros(fusion.WINDOW_MIN_BYTES // 4 - 1, np.float32)),
        "large alone": lambda: fused_of(np.zeros(fusion.PEER_BYTES // 4, np.float32)),
    }[case]()
    assert fused.window_sum(backend, window) is None
