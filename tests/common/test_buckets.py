"""Bucket assignment (common/buckets.py): DDP's rule with its smaller first bucket, and the
splitting of explicit groups."""

from __future__ import annotations

import random

from hpc_horovod.common.buckets import assign, split

MIB = 1 << 20


def test_one_bucket_a_kind_up_to_the_cap_with_a_smaller_first():
    items = [("a", 10), ("b", 10), ("a", 600), ("a", 600), ("b", 2000), ("a", 500)]
    assert assign(items, cap=1000) == [[0, 2, 3], [1, 4], [5]]
    assert assign(items, cap=1000, first_cap=500) == [[0, 2], [1, 4], [3, 5]]
    assert assign(items, cap=float("inf")) == [[0, 2, 3, 5], [1, 4]]


def test_a_gradient_of_unknown_size_goes_alone():
    assert assign([("a", 10), ("a", None), ("a", 10)], cap=100) == [[1], [0, 2]]


def test_an_mlp_in_two_buckets():
    # four linear layers, gradients in the order backward produces them (bias, weight)
    mlp = [("f32", 40), ("f32", 40960), ("f32", 4096), ("f32", 4 * MIB),
           ("f32", 4096), ("f32", 4 * MIB), ("f32", 4096), ("f32", 4 * MIB)]
    assert assign(mlp, 25 * MIB, MIB) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert assign(mlp, 0, 0) == [[i] for i in range(len(mlp))]


def test_every_item_in_exactly_one_bucket_of_one_kind_in_order():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 12)
        items = [(rng.choice("ab"), rng.choice([None, *range(0, 3000, 250)])) for _ in range(n)]
        result = assign(items, rng.choice([0, 500, 2000]), rng.choice([None, 0, 300]))
        assert sorted(i for bucket in result for i in bucket) == list(range(n)), result
        for bucket in result:
            assert len({items[i][0] for i in bucket}) == 1
            assert bucket == sorted(bucket)


def test_split_in_nearly_equal_chunks():
    assert split(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split([1], 3) == [[1]]
