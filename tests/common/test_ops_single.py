"""The numpy API (``hpc_horovod.common.ops``) in one process, without MPI: what a laptop, a
notebook or a one-task batch job runs. Every collective of a job of size 1 is the identity (times
the scale factors); bad input is refused with a clear error."""

from __future__ import annotations

import numpy as np
import pytest

import hpc_horovod as hvd
from hpc_horovod.common import basics, ops, request
from hpc_horovod.common.types import SUPPORTED_DTYPES, bfloat16

NUMERIC = [d for d in SUPPORTED_DTYPES if d != np.bool_]


def values(dtype, shape=(3, 4)) -> np.ndarray:
    return (np.arange(int(np.prod(shape))) % 7 + 1).reshape(shape).astype(dtype)


# -- allreduce ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", NUMERIC, ids=str)
@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product])
def test_allreduce_every_dtype_and_op_is_the_identity(single, dtype, op):
    x = values(dtype)
    out = single.allreduce(x, op=op)
    assert out.dtype == x.dtype and out.shape == x.shape
    np.testing.assert_array_equal(out, x)
    assert not np.shares_memory(out, x)


@pytest.mark.parametrize("op", [hvd.Min, hvd.Max])
def test_allreduce_bool_min_max(single, op):
    x = np.array([True, False, True])
    out = single.allreduce(x, op=op)
    assert out.dtype == np.bool_ and out.tolist() == x.tolist()


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32, np.float64], ids=str)
def test_allreduce_prescale_postscale(single, dtype):
    x = values(dtype)
    out = single.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
    assert out.dtype == x.dtype
    np.testing.assert_allclose(out.astype(np.float64), x.astype(np.float64) * 2.0, rtol=1e-2)
    out = single.allreduce(x, op=hvd.Max, prescale_factor=3.0)
    np.testing.assert_allclose(out.astype(np.float64), x.astype(np.float64) * 3.0, rtol=1e-2)


def test_allreduce_integer_scaling_truncates_like_a_cast(single):
    out = single.allreduce(np.array([1, 2, 3], np.int32), op=hvd.Sum, prescale_factor=2.5)
    assert out.dtype == np.int32 and out.tolist() == [2, 5, 7]


def test_allreduce_default_op_is_average_and_average_is_deprecated(single):
    x = np.array([2.0, 4.0])
    np.testing.assert_array_equal(single.allreduce(x), x)
    with pytest.warns(DeprecationWarning, match="replaced with `op`"):
        np.testing.assert_array_equal(single.allreduce(x, average=True), x)
    with pytest.warns(DeprecationWarning):
        np.testing.assert_array_equal(single.allreduce(x, average=False), x)
    with pytest.raises(ValueError, match="The op parameter supersedes average"):
        single.allreduce(x, average=True, op=hvd.Sum)


def test_allreduce_accepts_lists_scalars_and_strided_views(single):
    assert single.allreduce([1.0, 2.0], op=hvd.Sum).tolist() == [1.0, 2.0]
    assert single.allreduce(np.float32(3.0), op=hvd.Sum).shape == ()
    base = np.arange(12.0).reshape(3, 4)
    view = base[:, ::2]
    np.testing.assert_array_equal(single.allreduce(view, op=hvd.Sum), view)


def test_allreduce_in_place(single):
    x = np.array([1.0, 2.0, 3.0], np.float32)
    out = single.allreduce_(x, op=hvd.Sum, prescale_factor=2.0)
    assert out is x and x.tolist() == [2.0, 4.0, 6.0]
    h = single.allreduce_async_(x, op=hvd.Average)
    assert single.synchronize(h) is x
    y = np.arange(6, dtype=np.float16)
    assert single.allreduce_(y, op=hvd.Sum, postscale_factor=0.5) is y
    assert y.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]


@pytest.mark.parametrize("bad", [np.arange(6.0)[::2], np.asfortranarray(np.ones((2, 3))),
                                 [1.0, 2.0]], ids=["strided", "fortran", "list"])
def test_allreduce_in_place_needs_a_contiguous_array(single, bad):
    with pytest.raises(ValueError, match="in-place allreduce needs a writable C-contiguous"):
        single.allreduce_(bad)


def test_allreduce_in_place_refuses_read_only(single):
    x = np.ones(3)
    x.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        single.allreduce_(x)


def test_adasum_of_one_rank_is_the_identity(single):
    x = np.array([1.0, -2.0, 3.0], np.float32)
    np.testing.assert_allclose(single.allreduce(x, op=hvd.Adasum), x)


def test_grouped_allreduce(single):
    xs = [values(np.float32, (2,)), values(np.float64, (3, 2)), values(np.int32, (5,))]
    outs = single.grouped_allreduce(xs, op=hvd.Sum, name="g")
    for x, out in zip(xs, outs):
        assert out.dtype == x.dtype
        np.testing.assert_array_equal(out, x)
    handles = single.grouped_allreduce_async(xs, op=hvd.Sum)
    assert len(handles) == 3 and len(set(handles)) == 3
    assert all(single.synchronize(h) is not None for h in handles)


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("array", [np.ones(2, np.complex64), np.array(["a"]), np.array([{}]),
                                   np.ones(2, np.uint16), np.ones(2, np.uint64)], ids=str)
@pytest.mark.parametrize("call", [
    lambda a: hvd.allreduce(a, op=hvd.Sum), lambda a: hvd.allgather(a),
    lambda a: hvd.broadcast(a, 0), lambda a: hvd.alltoall(a),
    lambda a: hvd.reducescatter(a, op=hvd.Sum)])
def test_unsupported_dtype_is_a_value_error_listing_the_supported(single, array, call):
    with pytest.raises(ValueError) as info:
        call(array)
    assert f"does not support dtype {array.dtype}" in str(info.value)
    assert "float32" in str(info.value) and "bfloat16" in str(info.value)


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Product])
def test_bool_allreduce_needs_min_or_max(single, op):
    with pytest.raises(ValueError, match="supports only op=Min .* and op=Max"):
        single.allreduce(np.array([True]), op=op)


def test_bool_reducescatter_default_average_is_refused(single):
    with pytest.raises(ValueError, match="op=Min"):
        single.reducescatter(np.array([True, False]))


def test_adasum_needs_floating_point(single):
    with pytest.raises(ValueError, match="Adasum needs floating point tensors, not int32"):
        single.allreduce(np.ones(2, np.int32), op=hvd.Adasum)


def test_reducescatter_refuses_adasum_and_scalars(single):
    with pytest.raises(ValueError, match="does not support Adasum"):
        single.reducescatter(np.ones(2), op=hvd.Adasum)
    with pytest.raises(ValueError, match="at least one dimension"):
        single.reducescatter(np.float32(1.0))


@pytest.mark.parametrize("op", [7, -1, "sum"])
def test_unknown_op(single, op):
    with pytest.raises(ValueError, match="unknown reduction op"):
        single.allreduce(np.ones(2), op=op)


def test_duplicate_name_in_flight_is_a_value_error(single):
    engine = basics.engine()
    # No cycle runs, so the first request cannot complete before the second arrives: the
    # real-life case is a peer that has not submitted yet (tests/parallel).
    with engine.paused():
        first = single.allreduce_async(np.ones(2), name="grad")
        with pytest.raises(ValueError) as info:
            single.allreduce_async(np.ones(2), name="grad")
    assert "same name as another tensor that is currently being processed" in str(info.value)
    assert "[grad]" in str(info.value)
    np.testing.assert_array_equal(single.synchronize(first), np.ones(2))
    # once done, the name is free again
    single.synchronize(single.allreduce_async(np.ones(2), name="grad"))


def test_duplicate_name_within_one_submission_is_a_value_error(single):
    with pytest.raises(ValueError, match="same name"):
        ops.submit([request.allreduce_request(np.ones(2), name="x"),
                    request.allreduce_request(np.zeros(2), name="x")])


def test_handles(single):
    h = single.allreduce_async(np.ones(2), name="h")
    out = single.synchronize(h)
    np.testing.assert_array_equal(out, np.ones(2))
    with pytest.raises(ValueError, match=f"handle {h} was not created or has been cleared"):
        single.poll(h)
    with pytest.raises(ValueError, match="was not created"):
        single.synchronize(12345)
    h = single.allgather_async(np.ones(2))
    while not single.poll(h):
        pass
    assert single.synchronize(h).shape == (2,)


# -- the other collectives ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_allgather_broadcast_alltoall_every_dtype(single, dtype):
    x = values(dtype, (4, 3))
    gathered = single.allgather(x)
    np.testing.assert_array_equal(gathered, x)
    assert gathered.dtype == x.dtype
    out = single.broadcast(x, root_rank=0)
    np.testing.assert_array_equal(out, x)
    assert not np.shares_memory(out, x)
    received, splits = single.alltoall(x)
    np.testing.assert_array_equal(received, x)
    assert splits.tolist() == [4]


def test_allgather_of_a_scalar_is_a_vector(single):
    assert single.allgather(np.float64(2.5)).tolist() == [2.5]


def test_grouped_allgather(single):
    outs = single.grouped_allgather([np.ones((2, 2)), np.zeros(3, np.int8)])
    assert [o.shape for o in outs] == [(2, 2), (3,)]


def test_broadcast_in_place(single):
    x = np.arange(4.0)
    assert single.broadcast_(x, 0) is x
    with pytest.raises(ValueError, match="C-contiguous"):
        single.broadcast_(np.arange(8.0)[::2], 0)
    read_only = np.ones(3)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="needs a writable C-contiguous numpy array"):
        single.broadcast_(read_only, 0)


@pytest.mark.parametrize("root", [1, -1])
def test_broadcast_root_must_be_a_member(single, root):
    with pytest.raises(ValueError, match=f"root rank {root} is not a member"):
        single.broadcast(np.ones(2), root_rank=root)


def test_alltoall_with_splits(single):
    x = np.arange(10.0).reshape(5, 2)
    received, splits = single.alltoall(x, splits=[5])
    np.testing.assert_array_equal(received, x)
    assert splits.tolist() == [5]
    empty = np.empty((0, 2))
    received, splits = single.alltoall(empty, splits=np.array([0]))
    assert received.shape == (0, 2) and splits.tolist() == [0]


@pytest.mark.parametrize("splits,fragment", [
    ([2, 3], "splits has 2 entries but the process set has 1 ranks"),
    ([4], "must be non-negative and sum to the first dimension 5"),
    ([-1], "must be non-negative"),
])
def test_alltoall_splits_validation(single, splits, fragment):
    with pytest.raises(ValueError) as info:
        single.alltoall(np.ones((5, 2)), splits=splits)
    assert fragment in str(info.value)


@pytest.mark.parametrize("dtype", NUMERIC, ids=str)
def test_reducescatter(single, dtype):
    x = values(dtype, (5, 2))
    out = single.reducescatter(x, op=hvd.Sum)
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(out, x)


def test_reducescatter_average_and_scales(single):
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_allclose(single.reducescatter(x), x)
    np.testing.assert_allclose(single.reducescatter(x, op=hvd.Sum, prescale_factor=2.0,
                                                    postscale_factor=0.25), x * 0.5)
    outs = single.grouped_reducescatter([x, x[:3].astype(np.float64)], op=hvd.Sum)
    assert [o.dtype for o in outs] == [np.float32, np.float64]


def test_barrier_join_and_objects(single):
    single.barrier()
    assert single.join() == 0
    obj = {"epoch": 3, "lr": [0.1, 0.01], "f": lambda v: v + 1}
    got = single.broadcast_object(obj, root_rank=0)
    assert got["epoch"] == 3 and got["f"](1) == 2
    assert single.allgather_object(("rank", 0)) == [("rank", 0)]
    assert single.broadcast_object(None) is None


def test_allreduce_after_join_still_works(single):
    assert single.join() == 0
    np.testing.assert_array_equal(single.allreduce(np.ones(2), op=hvd.Sum), np.ones(2))


def test_many_unnamed_ops_in_flight(single):
    handles = [single.allreduce_async(np.full(3, i, np.float32), op=hvd.Sum) for i in range(50)]
    for i, h in enumerate(handles):
        np.testing.assert_array_equal(single.synchronize(h), np.full(3, i, np.float32))


# -- the requests ops.py builds -------------------------------------------------------------------
def test_automatic_names_count_per_kind(single):
    first = request.allreduce_request(np.ones(2))
    second = request.allreduce_request(np.ones(2))
    gathered = request.allgather_request(np.ones(2))
    assert (first.name, second.name) == ("allreduce.noname.0", "allreduce.noname.1")
    assert gathered.name == "allgather.noname.0"
    assert request.allreduce_request(np.ones(2), name="w").name == "w"


def test_grouped_names_number_the_members(single):
    assert request.group_names("grads", 3, 0, "allreduce") == ["grads.0", "grads.1", "grads.2"]
    assert request.group_names(None, 2, 0, "allreduce") == ["grouped_allreduce.noname.0.0",
                                                        "grouped_allreduce.noname.0.1"]


def test_a_scalar_allgather_request_is_a_vector(single):
    req = request.allgather_request(np.array(5.0))
    assert req.tensor.shape == (1,) and req.signature.shape == (-1,)


def test_a_non_contiguous_input_is_made_contiguous(single):
    strided = np.arange(12.0).reshape(3, 4).T
    np.testing.assert_array_equal(single.allreduce(strided, op=single.Sum), strided)
    np.testing.assert_array_equal(single.allgather(strided), strided)


def test_a_process_set_never_registered_is_named(single):
    ps = hvd.ProcessSet([0])  # neither passed to init nor added
    with pytest.raises(ValueError, match=r"is not registered \(was it removed\?\)"):
        single.allreduce(np.ones(2), process_set=ps)
