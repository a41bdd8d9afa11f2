"""Bucket assignment (common/buckets.py): DDP's rule, its smaller first bucket, and the last
bucket of the gradients produced last, cut between modules."""

from __future__ import annotations

from hpc_horovod.common.buckets import assign, split

MIB = 1 << 20

#: an MLP of four linear layers, in the order backward produces the gradients (bias, weight)
MLP = [("f32", 40), ("f32", 40960), ("f32", 4096), ("f32", 4 * MIB),
       ("f32", 4096), ("f32", 4 * MIB), ("f32", 4096), ("f32", 4 * MIB)]
MLP_LAYERS = ["fc4", "fc4", "fc3", "fc3", "fc2", "fc2", "fc1", "fc1"]


def test_one_bucket_a_kind_up_to_the_cap_with_a_smaller_first():
    items = [("a", 10), ("b", 10), ("a", 600), ("a", 600), ("b", 2000), ("a", 500)]
    assert assign(items, cap=1000) == [[0, 2, 3], [1, 4], [5]]
    assert assign(items, cap=1000, first_cap=500) == [[0, 2], [1, 4], [3, 5]]
    assert assign(items, cap=float("inf")) == [[0, 2, 3, 5], [1, 4]]


def test_a_gradient_of_unknown_size_goes_alone():
    assert assign([("a", 10), ("a", None), ("a", 10)], cap=100) == [[1], [0, 2]]


def test_without_a_last_cap_the_last_bucket_holds_what_is_left():
    assert assign(MLP, 25 * MIB, MIB) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_the_last_layer_goes_alone_and_the_one_before_starts_earlier():
    # fc2 no longer waits for fc1, the last layer backward reaches
    assert assign(MLP, 25 * MIB, MIB, MIB, MLP_LAYERS) == [[0, 1, 2, 3], [4, 5], [6, 7]]


def test_the_cut_does_not_split_a_module():
    # without modules, fc1's bias (produced with its weight) would hold fc2's bucket back
    assert assign(MLP, 25 * MIB, MIB, MIB) == [[0, 1, 2, 3], [4, 5, 6], [7]]


def test_the_last_bucket_gathers_small_layers_up_to_its_cap():
    # a CNN: two dense layers, then two small convolutions that backward reaches last
    cnn = [("f32", 40), ("f32", 10240), ("f32", 1024), ("f32", 4 * MIB),
           ("f32", 256), ("f32", 73728), ("f32", 128), ("f32", 3456)]
    layers = ["d2", "d2", "d1", "d1", "c2", "c2", "c1", "c1"]
    assert assign(cnn, 25 * MIB, MIB, MIB, layers) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # a cap below the convolutions' bytes: the last one alone
    assert assign(cnn, 25 * MIB, MIB, 8192, layers) == [[0, 1, 2, 3], [4, 5], [6, 7]]


def test_last_buckets_are_per_kind_and_stop_at_a_gradient_of_unknown_size():
    items = [("a", 10), ("b", 10), ("a", 2 * MIB), ("b", 5), ("a", None), ("a", 3)]
    assert assign(items, 25 * MIB, MIB, MIB) == [[0, 2], [4], [5], [1, 3]]


def test_a_zero_cap_keeps_one_gradient_a_bucket():
    assert assign(MLP, 0, 0, 0, MLP_LAYERS) == [[i] for i in range(len(MLP))]


def test_every_item_in_exactly_one_bucket():
    import random

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 12)
        items = [(rng.choice("ab"), rng.choice([None, *range(0, 3000, 250)])) for _ in range(n)]
        layers = [rng.randint(0, 3) for _ in range(n)]
        result = assign(items, rng.choice([0, 500, 2000]), rng.choice([0, 300]),
                        rng.choice([None, 0, 400, 1000]), rng.choice([None, layers]))
        flat = sorted(i for bucket in result for i in bucket)
        assert flat == list(range(n)), (items, result)
        for bucket in result:
            assert len({items[i][0] for i in bucket}) == 1
            assert bucket == sorted(bucket)


def test_split_in_nearly_equal_chunks():
    assert split(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split([1], 3) == [[1]]
