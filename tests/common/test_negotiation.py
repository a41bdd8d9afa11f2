"""Negotiation's pure parts: the response cache, the negotiation words and ``match``, whose
mismatch messages are Horovod's texts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_horovod.common.negotiation import (
    FLAG_ABORT,
    FLAG_JOINED,
    FLAG_SHUTDOWN,
    FLAG_STALL,
    FLAG_UNCACHED,
    ResponseCache,
    iter_bits,
    match,
    pack_words,
    stall_message,
    unpack_words,
)
from hpc_horovod.common.request import signature_of
from hpc_horovod.common.types import (
    Adasum,
    Average,
    Max,
    Signature,
    Sum,
    bfloat16,
    mismatch_message,
)


def sig(kind="allreduce", dtype="float32", shape=(4,), op=Average, root=-1, pre=1.0, post=1.0):
    return Signature(kind, dtype, shape, op, root, pre, post)


# -- ResponseCache --------------------------------------------------------------------------------
cache_ops = st.lists(st.tuples(st.sampled_from(["put", "put2", "evict", "touch"]),
                               st.sampled_from([f"t{i}" for i in range(12)])), max_size=80)


@settings(max_examples=200, deadline=None)
@given(cache_ops, st.integers(0, 8))
def test_cache_is_deterministic(ops, capacity):
    """Two ranks applying the same agreed sequence end with the same bits."""
    a, b = ResponseCache(capacity), ResponseCache(capacity)
    for cache in (a, b):
        for what, name in ops:
            if what == "evict":
                cache.evict(name)
            elif what == "touch":
                cache.touch([name])
            else:
                cache.put(name, sig(shape=(4,) if what == "put" else (5,)))
    names = {name for _, name in ops}
    assert len(a) == len(b) <= capacity
    assert a.valid_bits() == b.valid_bits()
    for name in names:
        for s in (sig(shape=(4,)), sig(shape=(5,))):
            assert a.bit(name, s) == b.bit(name, s)
    # bits are unique and name() inverts bit()
    held = {name: bit for name in names for s in (sig(shape=(4,)), sig(shape=(5,)))
            if (bit := a.bit(name, s)) is not None}
    assert len(held) == len(set(held.values())) == len(a)
    assert all(a.name(bit) == name for name, bit in held.items())
    assert a.valid_bits() == sum(1 << bit for bit in held.values())


def test_cache_bit_needs_the_same_signature():
    cache = ResponseCache(4)
    cache.put("grad", sig())
    assert cache.bit("grad", sig()) == 0
    assert cache.bit("grad", sig(dtype="float64")) is None
    assert cache.bit("other", sig()) is None
    assert cache.signature("grad") == sig()


def test_cache_reuses_the_lowest_freed_bit():
    cache = ResponseCache(8)
    for i in range(4):
        cache.put(f"t{i}", sig())
    cache.evict("t2")
    cache.evict("t1")
    cache.put("new", sig())
    assert cache.bit("new", sig()) == 1
    assert cache.name(2) is None
    assert cache.valid_bits() == 0b1011


def test_cache_put_with_a_new_signature_replaces_the_entry():
    cache = ResponseCache(4)
    cache.put("a", sig())
    cache.put("b", sig())
    cache.put("a", sig(shape=(9,)))
    assert cache.bit("a", sig()) is None
    assert cache.bit("a", sig(shape=(9,))) == 0
    assert len(cache) == 2


def test_a_full_cache_evicts_the_least_recently_used_name():
    cache = ResponseCache(2)
    cache.put("a", sig())
    cache.put("b", sig())
    cache.touch(["a"])  # "b" is now the oldest
    cache.put("c", sig())
    assert len(cache) == 2 and cache.bit("b", sig()) is None
    assert cache.bit("a", sig()) == 0 and cache.bit("c", sig()) == 1  # b's bit, reused
    assert cache.nwords == 1
    empty = ResponseCache(0)
    empty.put("a", sig())
    assert len(empty) == 0 and empty.nwords == 0


def test_recency_is_tracked_once_the_cache_is_half_full():
    cache = ResponseCache(4)
    cache.put("a", sig())
    cache.put("b", sig())
    assert not cache.tracks_use
    cache.put("c", sig())
    assert cache.tracks_use


def test_cache_words_grow_by_64_bits():
    cache = ResponseCache(200)
    for i in range(65):
        cache.put(str(i), sig())
    assert cache.nwords == 2


# -- negotiation words ----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 1), st.integers(0, 2**130 - 1)),
                min_size=1, max_size=6))
def test_words_and_reduced_over_ranks_give_or_flags_and_flags_and_common_bits(ranks):
    nwords = 3
    words = [pack_words(o, a, b, nwords) for o, a, b in ranks]
    assert all(w.dtype == np.uint64 and w.shape == (2 + nwords,) for w in words)
    for (o, a, b), w in zip(ranks, words):
        assert unpack_words(w) == (o, a, b)
    reduced = np.bitwise_and.reduce(np.stack(words))  # what the backend's BAND allreduce does
    or_flags, and_flags, bits = unpack_words(reduced)
    expected_or, expected_and, expected_bits = 0, 1, 2**192 - 1
    for o, a, b in ranks:
        expected_or |= o
        expected_and &= a
        expected_bits &= b
    assert (or_flags, and_flags, bits) == (expected_or, expected_and, expected_bits)


def test_words_without_cache_bits():
    words = pack_words(FLAG_SHUTDOWN | FLAG_STALL, FLAG_JOINED, 0, 0)
    assert words.shape == (2,)
    assert unpack_words(words) == (FLAG_SHUTDOWN | FLAG_STALL, FLAG_JOINED, 0)


def test_flags_are_distinct_bits():
    flags = [FLAG_UNCACHED, FLAG_SHUTDOWN, FLAG_STALL, FLAG_ABORT]
    assert all(f & (f - 1) == 0 for f in flags) and len(set(flags)) == 4


@given(st.integers(0, 2**200))
def test_iter_bits_lists_set_bits_in_order(mask):
    bits = list(iter_bits(mask))
    assert bits == sorted(bits)
    assert sum(1 << b for b in bits) == mask


# -- match ----------------------------------------------------------------------------------------
def test_match_ready_when_every_rank_submitted_in_first_appearance_order():
    gathered = [
        [("a", sig()), ("b", sig()), ("c", sig())],
        [("c", sig()), ("b", sig()), ("a", sig())],
    ]
    agreement = match(gathered, set())
    assert [name for name, _ in agreement.ready] == ["a", "b", "c"]
    assert agreement.errors == [] and agreement.waiting == {}


def test_match_order_is_the_same_whatever_rank_computes_it():
    gathered = [[("x", sig()), ("y", sig())], [("y", sig()), ("x", sig())], [("y", sig())]]
    first = match(gathered, set())
    again = match([list(g) for g in gathered], set())
    assert first == again
    assert first.ready == [("y", sig())] and first.waiting == {"x": [2]}


def test_match_reports_missing_ranks():
    gathered = [[("a", sig())], [], [("a", sig()), ("b", sig())]]
    agreement = match(gathered, set())
    assert agreement.ready == []
    assert agreement.waiting == {"a": [1], "b": [0, 1]}


def test_match_joined_ranks_count_as_ready():
    gathered = [[("a", sig())], [], [("a", sig())]]
    agreement = match(gathered, joined={1})
    assert agreement.ready == [("a", sig())]


@pytest.mark.parametrize("kind", ["allreduce", "barrier"])
def test_match_allows_these_kinds_with_joined_ranks(kind):
    s = sig(kind=kind)
    assert match([[("t", s)], []], joined={1}).ready == [("t", s)]


@pytest.mark.parametrize("kind", ["allgather", "broadcast", "alltoall", "reducescatter"])
def test_match_refuses_other_kinds_with_joined_ranks(kind):
    """As in Horovod: the ranks that submitted it get an error at once instead of waiting."""
    s = sig(kind=kind, root=0 if kind == "broadcast" else -1)
    agreement = match([[("t", s)], []], joined={1})
    assert agreement.ready == []
    ((name, message),) = agreement.errors
    assert name == "t" and message.startswith(f"{kind.capitalize()} is not supported with Join")
    assert message == f"{kind.capitalize()} is not supported with Join at this time. [tensor 't']"


def test_match_names_the_tensor_and_ranks_of_a_mismatch():
    gathered = [[("w", sig())], [("w", sig())], [("w", sig(dtype="int32"))]]
    agreement = match(gathered, set())
    assert agreement.ready == []
    ((name, message),) = agreement.errors
    assert name == "w"
    assert message == ("Mismatched data types: One rank had type float32, but another rank had "
                       "type int32. [tensor 'w': rank 0 vs rank 2]")


def test_match_keeps_good_tensors_next_to_a_bad_one():
    gathered = [[("good", sig()), ("bad", sig())], [("bad", sig(op=Sum)), ("good", sig())]]
    agreement = match(gathered, set())
    assert agreement.ready == [("good", sig())]
    assert [name for name, _ in agreement.errors] == ["bad"]


# -- Horovod's mismatch texts ---------------------------------------------------------------------
f32, i32 = np.zeros((17, 3), np.float32), np.zeros((17, 3), np.int32)


@pytest.mark.parametrize("a,b,text", [
    (signature_of("allreduce", f32), signature_of("allreduce", i32),
     "Mismatched data types: One rank had type float32, but another rank had type int32."),
    (signature_of("allgather", np.zeros(3, bfloat16)), signature_of("allgather", f32),
     "Mismatched data types: One rank had type bfloat16, but another rank had type float32."),
    (signature_of("allreduce", f32), signature_of("allgather", f32),
     "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER."),
    (signature_of("broadcast", f32, root=0), signature_of("allreduce", f32),
     "Mismatched operations: One rank did an BROADCAST, but another rank did an ALLREDUCE."),
    (signature_of("allreduce", f32, op=Sum), signature_of("allreduce", f32, op=Adasum),
     "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ADASUM."),
    (signature_of("allreduce", f32), signature_of("allreduce", np.zeros((17, 4), np.float32)),
     "Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [17, 3], but another "
     "rank sent a tensor of shape [17, 4]."),
    (signature_of("broadcast", f32, root=0), signature_of("broadcast", np.zeros(51, np.float32),
                                                          root=0),
     "Mismatched BROADCAST tensor shapes: One rank sent a tensor of rank 2, but another rank "
     "sent a tensor of rank 1."),
    (signature_of("reducescatter", f32), signature_of("reducescatter",
                                                      np.zeros((16, 3), np.float32)),
     "Mismatched REDUCESCATTER tensor shapes: One rank sent a tensor of shape [17, 3], but "
     "another rank sent a tensor of shape [16, 3]."),
    (signature_of("allgather", np.zeros((5, 3, 2), np.float32)),
     signature_of("allgather", np.zeros((7, 3, 4), np.float32)),
     "Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 2 equal to 2, "
     "but another rank sent a tensor with dimension 2 equal to 4."),
    (signature_of("alltoall", np.zeros((4, 3), np.float32)),
     signature_of("alltoall", np.zeros((4,), np.float32)),
     "Mismatched ALLTOALL tensor shapes: One rank sent a tensor of rank 2, but another rank "
     "sent a tensor of rank 1."),
    (signature_of("allreduce", f32, prescale=0.5), signature_of("allreduce", f32),
     "Mismatched prescale and/or postscale factors: One rank sent factors (0.5, 1), but another "
     "rank sent factors (1, 1)."),
    (signature_of("allreduce", f32, postscale=2.0), signature_of("allreduce", f32),
     "Mismatched prescale and/or postscale factors: One rank sent factors (1, 2), but another "
     "rank sent factors (1, 1)."),
    (signature_of("allreduce", f32, op=Sum), signature_of("allreduce", f32, op=Max),
     "Mismatched reduction operation: One rank sent reduction op Sum, but another rank sent "
     "reduction op Max."),
    (signature_of("broadcast", f32, root=0), signature_of("broadcast", f32, root=1),
     "Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank "
     "specified root rank 1."),
])
def test_mismatch_messages_are_horovods(a, b, text):
    assert mismatch_message(a, b) == text


def test_process_sets_added_with_different_ranks():
    a, b = sig("process_set_add", "", (0, 1), 0), sig("process_set_add", "", (0, 2), 0)
    assert mismatch_message(a, b) == ("Mismatched process sets: One rank added a process set of "
                                      "ranks [0, 1], but another rank added ranks [0, 2].")


def test_allgather_and_alltoall_first_dimensions_may_differ():
    for kind in ("allgather", "alltoall"):
        a = signature_of(kind, np.zeros((2, 3), np.float32))
        b = signature_of(kind, np.zeros((9, 3), np.float32))
        assert a == b and mismatch_message(a, b) is None


def test_equal_signatures_agree():
    assert mismatch_message(signature_of("allreduce", f32), signature_of("allreduce", f32)) \
        is None


# -- stall message --------------------------------------------------------------------------------
def test_stall_message_names_missing_ranks_and_their_tensors():
    text = stall_message({"grad.w": [1, 2], "grad.b": [2]}, 60)
    assert text.startswith("One or more tensors were submitted to be reduced, gathered or "
                           "broadcasted by subset of ranks and are waiting for remainder of ranks "
                           "for more than 60 seconds.")
    assert "Missing ranks:\n1: [grad.w]\n2: [grad.w, grad.b]" in text


def test_stall_message_shortens_long_lists():
    text = stall_message({f"t{i}": [0] for i in range(13)}, 1.5)
    assert "more than 1.5 seconds" in text
    assert "0: [t0, t1, t2, t3, t4, t5, t6, t7, t8, t9 and 3 more]" in text
