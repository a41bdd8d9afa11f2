"""The per-tensor path in C (``_native.Request`` and ``_native.Lane``, src_native/lane.c) against
the engine's Python, which it stands in for: same requests, same handles, same errors.

Engines here run on the single-process backend and their thread is never started: every cycle
is one a waiter runs.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from hpc_horovod.backends.single import SingleBackend
from hpc_horovod.common import engine as engine_mod
from hpc_horovod.common import request as request_mod
from hpc_horovod.common.basics import ProcessSet, global_process_set
from hpc_horovod.common.config import Settings
from hpc_horovod.common.errors import HorovodInternalError
from hpc_horovod.common.request import signature_of
from hpc_horovod.common.types import Average, Sum

_native = pytest.importorskip("hpc_horovod._native")
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["lane", "python"])
def engine(request, monkeypatch):
    """An engine with the native lane, and one with the Python it replaces."""
    if request.param == "python":
        monkeypatch.setattr(engine_mod, "Lane", None)
    eng = engine_mod.Engine(SingleBackend(), Settings())
    assert (eng.lane is not None) == (request.param == "lane")
    return eng


def allreduce(name: str, x: np.ndarray, output=None, ps_id: int = 0):
    return request_mod.Request(name, x, signature_of("allreduce", x, Sum), ps_id, output)


def test_the_request_type_is_the_native_one_with_python_defaults():
    assert request_mod.Request is _native.Request
    x = np.ones(3)
    sig = signature_of("allreduce", x, Sum)
    req = _native.Request("g", x, sig)
    assert (req.name, req.tensor, req.signature) == ("g", x, sig)
    assert req.key == (0, "g") and req.kind == "allreduce" and req.process_set_id == 0
    assert req.output is None and req.splits is None and req.result is None
    assert req.error is None and req.done is False and req.handle is None
    req.done, req.result = True, x
    assert req.done is True and req.result is x
    with pytest.raises(AttributeError):
        req.anything = 1  # fixed fields, as the Python class's __slots__
    other = _native.Request(name="h", tensor=None, signature=sig, process_set_id=3, output=x)
    assert other.key == (3, "h") and other.output is x
    assert other.result is x  # an op with an output returns it, as the Python class says


def test_requests_in_a_reference_cycle_are_collected():
    class Marker:
        pass

    req = _native.Request("g", np.ones(2), signature_of("allreduce", np.ones(2), Sum))
    marker = Marker()
    req.result = [req, marker]  # a cycle through a field, holding the marker
    alive = weakref.ref(marker)
    del req, marker
    gc.collect()
    assert alive() is None


def test_submit_and_wait_give_the_same_results(engine):
    xs = [np.arange(n, dtype=np.float32) for n in (1, 4, 9)]
    handles = [engine.submit(allreduce(f"t{i}", x)) for i, x in enumerate(xs)]
    inplace = np.full(5, 2.0)
    handles.append(engine.submit(allreduce("in", inplace, output=inplace)))
    assert handles == sorted(handles) and len(set(handles)) == 4
    for handle, x in zip(handles, xs):
        np.testing.assert_array_equal(engine.wait(handle).result, x)
    assert engine.wait(handles[-1]).result is inplace
    assert not engine._inflight and not engine._handles and not engine._queue


def test_duplicate_names_and_unknown_sets_raise_the_engines_errors(engine):
    x = np.ones(2)
    engine.submit(allreduce("same", x))
    with pytest.raises(ValueError, match=r"same name as another tensor.*\[same\]"):
        engine.submit(allreduce("same", x))
    with pytest.raises(ValueError, match="process set 7 does not exist"):
        engine.submit(allreduce("elsewhere", x, ps_id=7))
    assert list(engine._inflight) == [(0, "same")] and len(engine._queue) == 1


def test_a_stopped_engine_refuses_submissions(engine):
    engine.shutdown()  # its thread never ran: the shutdown is only recorded
    with pytest.raises(ValueError, match="shut down"):
        engine.submit(allreduce("late", np.ones(2)))
    assert not engine._queue


def test_push_refuses_what_is_not_a_request():
    eng = engine_mod.Engine(SingleBackend(), Settings())
    with pytest.raises(TypeError, match="expected a Request"):
        eng.lane.push(("not", "a", "request"))


@pytest.fixture
def lane_engine():
    eng = engine_mod.Engine(SingleBackend(), Settings())
    eng._members[global_process_set.process_set_id] = [0]
    return eng


@pytest.mark.parametrize("in_place", [False, True])
def test_allreduce_builds_the_request_the_python_path_builds(lane_engine, in_place):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    handle = lane_engine.lane.allreduce(x, "g", None, 1.0, 1.0, global_process_set, in_place)
    req = lane_engine.request(handle)
    assert req.signature is signature_of("allreduce", x, Average, -1, 1.0, 1.0)
    assert req.handle == handle and req.key == (0, "g") and req.tensor is x
    assert req.output is (x if in_place else None)
    result = lane_engine.lane.wait(handle).result  # not done yet: Engine.wait runs the cycle
    np.testing.assert_array_equal(result, np.arange(6).reshape(2, 3))
    assert (result is x) == in_place and handle not in lane_engine._handles


def test_remembered_signatures_are_signature_ofs(lane_engine):
    """The lane remembers the signatures it was given: every combination of dtype, shape, op
    and scales must still get its own, the one ``signature_of`` interns."""
    lane, ps = lane_engine.lane, global_process_set
    combos = [(dtype, shape, op, pre, post)
              for dtype in (np.float32, np.float64, np.int32)
              for shape in ((4,), (2, 2), (4, 1), (5,), (), (1,), (2, 1, 2), (1, 2, 2))
              for op in (None, Sum, 3)
              for pre, post in ((1.0, 1.0), (0.5, 1.0), (1.0, 0.5), (-0.0, 1.0), (0.0, 1.0))]
    for rep in range(2):  # the second time, from memory
        for i, (dtype, shape, op, pre, post) in enumerate(combos):
            x = np.ones(shape, dtype)
            handle = lane.allreduce(x, f"{rep}.{i}", op, pre, post, ps, False)
            expected = signature_of("allreduce", x, Average if op is None else op, -1, pre, post)
            assert lane_engine.request(handle).signature is expected, (rep, dtype, shape, op)
    assert lane.allreduce(np.ones(2), "huge op", 10**30, 1.0, 1.0, ps, False) is None


def test_allreduce_leaves_the_uncommon_cases_to_python(lane_engine):
    lane, ps = lane_engine.lane, global_process_set
    x = np.ones(4, np.float32)
    read_only = np.ones(4, np.float32)
    read_only.flags.writeable = False
    unregistered = ProcessSet([0])
    cases = [
        ([1.0, 2.0], "a", None, 1.0, 1.0, ps, False),  # not an ndarray
        (np.ones((4, 4))[:, 0], "b", None, 1.0, 1.0, ps, False),  # not contiguous
        (np.asfortranarray(np.ones((3, 4))), "f", None, 1.0, 1.0, ps, False),  # Fortran order
        (read_only, "c", None, 1.0, 1.0, ps, True),  # in place into a read-only array
        (x, None, None, 1.0, 1.0, ps, False),  # a generated name
        (x, "d", None, 2, 1.0, ps, False),  # an int scale
        (x, "e", None, 1.0, 1.0, unregistered, False),  # a set without an id
    ]
    for args in cases:
        assert lane.allreduce(*args) is None, args
    assert not lane_engine._queue and not lane_engine._inflight


def test_allreduce_raises_what_signature_of_raises(lane_engine):
    with pytest.raises(ValueError, match="does not support dtype complex64"):
        lane_engine.lane.allreduce(np.ones(2, np.complex64), "z", None, 1.0, 1.0,
                                   global_process_set, False)
    assert not lane_engine._inflight


def test_wait_returns_done_requests_and_raises_errors_and_unknown_handles(lane_engine):
    lane = lane_engine.lane
    handle = lane.allreduce(np.ones(2), "f", Sum, 1.0, 1.0, global_process_set, False)
    req = lane_engine.request(handle)
    req.error, req.done = HorovodInternalError("it broke"), True
    with pytest.raises(HorovodInternalError, match="it broke"):
        lane.wait(handle)
    with pytest.raises(ValueError, match="was not created or has been cleared"):
        lane.wait(handle)
    done = lane_engine.request(lane.allreduce(np.ones(2), "d", Sum, 1.0, 1.0,
                                              global_process_set, False))
    done.result, done.done = "the result", True
    assert lane.wait(done.handle) is done and done.handle not in lane_engine._handles
    assert lane_engine.wait is not engine_mod.Engine.wait  # the engine's wait is the lane's


def test_cache_bits_agrees_with_the_python_twin():
    rng = np.random.default_rng(0)
    lane = engine_mod.Engine(SingleBackend(), Settings()).lane
    x, y = np.ones(3), np.ones(4, np.float32)
    sig_x, sig_y = signature_of("allreduce", x, Sum), signature_of("allreduce", y, Sum)
    for trial in range(50):
        pending, entries = {}, {}
        for i in range(int(rng.integers(0, 300))):
            name = f"t{trial}.{i}"
            tensor, sig = (x, sig_x) if rng.random() < 0.5 else (y, sig_y)
            pending[name] = _native.Request(name, tensor, sig, 0,
                                            tensor if rng.random() < 0.9 else None)
            roll = rng.random()
            if roll < 0.8:
                entries[name] = (int(rng.integers(0, 1024)), sig)
            elif roll < 0.9:  # cached with another signature
                entries[name] = (int(rng.integers(0, 1024)), sig_y if sig is sig_x else sig_x)
        assert lane.cache_bits(pending, entries) == engine_mod._cache_bits(pending, entries)
    assert lane.cache_bits({}, {}) == (0, False, True) == engine_mod._cache_bits({}, {})


def test_admit_moves_the_queue_into_the_sets_and_leaves_joins_and_strangers(lane_engine):
    x = np.ones(2)
    ps0 = lane_engine._sets[0]
    queue = lane_engine._queue
    reqs = [allreduce("a", x), allreduce("b", x, ps_id=5),
            request_mod.Request("join", None, request_mod.control_signature("join")),
            allreduce("c", x)]
    queue.extend(reqs)
    left = lane_engine.lane.admit(12.5)
    assert left == [reqs[1], reqs[2]] and not queue
    assert list(ps0.pending) == ["a", "c"] and ps0.pending["c"] is reqs[3]
    assert [r.submitted_at for r in reqs] == [12.5] * 4


def test_complete_marks_done_and_forgets_the_names(lane_engine):
    x = np.ones(2)
    reqs = [allreduce("a", x), allreduce("b", x)]
    for req in reqs:
        lane_engine._inflight[req.key] = req
    lane_engine.lane.complete([reqs[0], None, reqs[1]])
    assert all(req.done for req in reqs) and not lane_engine._inflight
    lane_engine.lane.complete([reqs[0]])  # already forgotten: no error
    with pytest.raises(TypeError):
        lane_engine.lane.complete([object()])
