"""Tests for jax_wgrad.grads.plan: Megatron's bucket layout of the flat gradient buffer.

The first group ports Megatron-LM's own unit tests of ``_ParamAndGradBuffer``
(its ``unit_tests/distributed/test_param_and_grad_buffer.py``: ``test_bucket_sizes`` and
``test_param_to_index_alignment_with_padding``) with their gold-value computation. The rest
are hand-computed edge cases and a randomized check of layout invariants.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from jax_wgrad.grads.plan import (
    Bucket,
    BucketPlan,
    bucket_end_divisor,
    param_shards,
    plan_buckets,
    shard_range,
)

# ----------------------------------------------------------------------------------------
# Port of Megatron's test_bucket_sizes.
#
# Megatron's TestModel is ``num_layers`` x ``Linear(input_dim, output_dim, bias)``; its
# parameters are registered as [w0, (b0), w1, (b1), ...], and with ``shared_embedding`` the
# *last layer's weight* carries the flag (it is the last registered parameter when
# bias=False, so it comes first in backprop order). The test runs under the job's
# data-parallel world size; here dp_size is a parameter.
# ----------------------------------------------------------------------------------------


def _test_model_numels(input_dim, output_dim, num_layers, bias, shared_embedding):
    numels, shared = [], []
    for layer in range(num_layers):
        numels.append(input_dim * output_dim)
        shared.append(shared_embedding and layer == num_layers - 1)
        if bias:
            numels.append(output_dim)
            shared.append(False)
    return numels, shared


def _megatron_gold(param_sizes, bucket_size, use_distributed_optimizer, shared_embedding, dp):
    """Megatron's gold computation from test_bucket_sizes (unpadded and padded bucket sizes)."""

    def pad_if_needed(n, divisor):
        return math.ceil(n / divisor) * divisor if use_distributed_optimizer else n

    def pad_bucket(n):
        return pad_if_needed(n, math.lcm(dp, 128))

    def pad_param(n):
        return pad_if_needed(n, 64)

    unpadded, padded = [], []
    param_sizes = list(param_sizes)
    # Separate bucket for the first parameter in reverse direction (the shared embedding).
    if shared_embedding and use_distributed_optimizer:
        unpadded.append(param_sizes[-1])
        padded.append(pad_bucket(param_sizes[-1]))
        param_sizes = param_sizes[:-1]
    in_last = 0
    for size in param_sizes[::-1]:
        in_last = pad_param(in_last)
        in_last += size
        if in_last >= bucket_size:
            unpadded.append(in_last)
            padded.append(pad_bucket(in_last))
            in_last = 0
    if in_last > 0:
        unpadded.append(in_last)
        padded.append(pad_bucket(in_last))
    return unpadded, padded


@pytest.mark.parametrize("dp_size", [1, 2, 6, 8])
@pytest.mark.parametrize("bucket_size", [None, 9000, 9025, 9050, 18000, 18050, 20000])
@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shared_embedding", [False, True])
def test_bucket_sizes_megatron(
    dp_size, bucket_size, use_distributed_optimizer, bias, shared_embedding
):
    if shared_embedding and bias:
        pytest.skip("Megatron skips shared_embedding + bias (gold values are trickier)")
    numels, shared = _test_model_numels(95, 95, 10, bias, shared_embedding)
    plan = plan_buckets(
        numels,
        dp_size=dp_size,
        bucket_size=bucket_size,
        use_distributed_optimizer=use_distributed_optimizer,
        shared_embedding=shared,
    )
    actual_unpadded = [b.numel_unpadded for b in plan.buckets]
    actual_padded = [b.numel for b in plan.buckets]
    if bucket_size is None:
        expected_count = 2 if (shared_embedding and use_distributed_optimizer) else 1
        assert len(plan.buckets) == expected_count
        return
    unpadded, padded = _megatron_gold(
        numels, bucket_size, use_distributed_optimizer, shared_embedding, dp_size
    )
    assert actual_unpadded == unpadded
    if use_distributed_optimizer:
        assert all(n % dp_size == 0 for n in actual_padded)
    assert actual_padded == padded


# The same test's numbers written out by hand for dp_size=8 (lcm(8, 128) = 128).
# Weight: 95*95 = 9025 elements, bias: 95.
@pytest.mark.parametrize(
    "bias,use_do,bucket_size,unpadded,padded",
    [
        # Each weight alone reaches 9000: ten buckets of one weight.
        (False, True, 9000, [9025] * 10, [9088] * 10),
        (False, False, 9000, [9025] * 10, [9025] * 10),
        # Two weights: second starts at pad64(9025) = 9088, ends at 18113 >= 18000.
        (False, True, 18000, [18113] * 5, [18176] * 5),
        (False, False, 18000, [18050] * 5, [18050] * 5),
        # Reverse order is b9, w9, b8, w8, ...: b@0..95, w@128..9153, b@9216..9311,
        # w@9344..18369 >= 18050.
        (True, True, 18050, [18369] * 5, [18432] * 5),
        (True, False, 18050, [18240] * 5, [18240] * 5),
        # 9025 with bias: b@0..95, w@128..9153 >= 9025.
        (True, True, 9025, [9153] * 10, [9216] * 10),
        (True, False, 9025, [9120] * 10, [9120] * 10),
    ],
)
def test_bucket_sizes_hand_computed(bias, use_do, bucket_size, unpadded, padded):
    numels, _ = _test_model_numels(95, 95, 10, bias, False)
    plan = plan_buckets(
        numels, dp_size=8, bucket_size=bucket_size, use_distributed_optimizer=use_do
    )
    assert [b.numel_unpadded for b in plan.buckets] == unpadded
    assert [b.numel for b in plan.buckets] == padded
    assert [b.offset for b in plan.buckets] == [sum(padded[:i]) for i in range(len(padded))]
    assert plan.numel == sum(padded)
    assert plan.numel_unpadded == sum(unpadded)


def test_bucket_sizes_none_shared_embedding_hand_computed():
    # Megatron: with bucket_size=None and a shared embedding, 2 buckets under dist-opt.
    numels, shared = _test_model_numels(95, 95, 10, False, True)
    plan = plan_buckets(
        numels, dp_size=8, bucket_size=None, use_distributed_optimizer=True, shared_embedding=shared
    )
    # Embedding (last registered) first: [0, 9025) padded to 9088; then nine weights each
    # 64-aligned: 8 * 9088 + 9025 = 81729 unpadded, padded to 81792.
    assert plan.param_ranges[-1] == (0, 9025, 0)
    assert [(b.offset, b.numel_unpadded, b.numel) for b in plan.buckets] == [
        (0, 9025, 9088),
        (9088, 81729, 81792),
    ]
    assert plan.numel == 9088 + 81792


# ----------------------------------------------------------------------------------------
# Port of Megatron's test_param_to_index_alignment_with_padding.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp_size", [1, 8])
def test_param_to_index_alignment_with_padding(dp_size):
    # One Linear(4, 4, bias): weight 16 elements, bias 4. 16 % 64 != 0, so padding shows.
    plan = plan_buckets([16, 4], dp_size=dp_size, bucket_size=None, use_distributed_optimizer=True)
    (bucket,) = plan.buckets
    naive_offset = 0
    padding_observed = False
    for k in bucket.param_indices:
        start, end, bucket_id = plan.param_ranges[k]
        assert bucket_id == bucket.bucket_id
        local_start, local_end = start - bucket.offset, end - bucket.offset
        assert local_end - local_start == [16, 4][k]
        if local_start != naive_offset:
            padding_observed = True
        naive_offset = local_end
    assert padding_observed
    assert plan.param_ranges == ((64, 80, 0), (0, 4, 0))
    assert (bucket.numel_unpadded, bucket.numel) == (80, 128)


# ----------------------------------------------------------------------------------------
# Edge cases, computed by hand.
# ----------------------------------------------------------------------------------------


def test_single_param():
    plan = plan_buckets([1000], dp_size=8, bucket_size=None, use_distributed_optimizer=True)
    assert plan.param_ranges == ((0, 1000, 0),)
    assert plan.buckets == (Bucket(0, 0, 1000, 1024, (0,)),)
    assert (plan.numel, plan.numel_unpadded) == (1024, 1000)
    assert plan.padding == 24
    plan = plan_buckets([1000], dp_size=8, bucket_size=1, use_distributed_optimizer=False)
    assert plan.buckets == (Bucket(0, 0, 1000, 1000, (0,)),)
    assert plan.padding == 0 and plan.padding_fraction == 0.0


def test_none_gives_one_bucket_and_small_size_one_per_param():
    numels = [300, 5, 70000, 1, 129]
    for use_do in (False, True):
        plan = plan_buckets(numels, dp_size=4, bucket_size=None, use_distributed_optimizer=use_do)
        assert len(plan.buckets) == 1
        assert plan.buckets[0].param_indices == (4, 3, 2, 1, 0)
        plan = plan_buckets(numels, dp_size=4, bucket_size=1, use_distributed_optimizer=use_do)
        assert [b.param_indices for b in plan.buckets] == [(4,), (3,), (2,), (1,), (0,)]


def test_no_distributed_optimizer_packs_without_padding():
    plan = plan_buckets([10, 20, 30], dp_size=3, bucket_size=None, use_distributed_optimizer=False)
    assert plan.param_ranges == ((50, 60, 0), (30, 50, 0), (0, 30, 0))
    assert (plan.numel, plan.numel_unpadded) == (60, 60)


def test_bucket_closes_when_span_reaches_size():
    # ">=": a bucket whose span equals bucket_size closes; the next starts at its end.
    kw = dict(dp_size=1, use_distributed_optimizer=False)
    plan = plan_buckets([100, 100, 100], bucket_size=100, **kw)
    assert [(b.offset, b.numel) for b in plan.buckets] == [(0, 100), (100, 100), (200, 100)]
    plan = plan_buckets([100, 100, 100], bucket_size=101, **kw)
    assert [(b.offset, b.numel, b.param_indices) for b in plan.buckets] == [
        (0, 200, (2, 1)),
        (200, 100, (0,)),
    ]
    # A bucket closed by the last parameter leaves no empty trailing bucket.
    plan = plan_buckets([50, 50, 100], bucket_size=100, **kw)
    assert [b.param_indices for b in plan.buckets] == [(2,), (1, 0)]


def test_bucket_size_span_counts_from_padded_bucket_start():
    # dist-opt, dp=1: p2 [0,100) -> bucket 0 ends at pad128(100) = 128 (span 100 >= 100).
    # p1 starts at 128, p0 at pad64(128+10) = 192, ends 202; span from 128 = 74 < 100.
    plan = plan_buckets([10, 10, 100], dp_size=1, bucket_size=100, use_distributed_optimizer=True)
    assert plan.param_ranges == ((192, 202, 1), (128, 138, 1), (0, 100, 0))
    assert [(b.offset, b.numel_unpadded, b.numel) for b in plan.buckets] == [
        (0, 100, 128),
        (128, 74, 128),
    ]


def test_shared_embedding_last_registered():
    # Last registered = first in backprop order: own bucket first (Megatron's test layout).
    plan = plan_buckets(
        [100, 200, 1000],
        dp_size=2,
        bucket_size=None,
        use_distributed_optimizer=True,
        shared_embedding=[False, False, True],
    )
    # Embedding @ [0,1000), its bucket padded to 1024. p1 @ [1024,1224), p0 @ [1280,1380):
    # bucket 1 unpadded 1380 - 1024 = 356, end pad128(1380) = 1408.
    assert plan.param_ranges == ((1280, 1380, 1), (1024, 1224, 1), (0, 1000, 0))
    assert [(b.offset, b.numel_unpadded, b.numel, b.param_indices) for b in plan.buckets] == [
        (0, 1000, 1024, (2,)),
        (1024, 356, 384, (1, 0)),
    ]


def test_shared_embedding_first_registered_closes_pending_bucket_at_aligned_start():
    # Reverse order: p2 (200) @ [0,200), p1 (130) @ [256,386). The embedding's start is
    # padded to 448 *before* the pending bucket is closed there, so bucket 0's
    # numel_unpadded is 448 (not 386) and its end is pad128(448) = 512 (Megatron:
    # ``param_start_index = _update_bucket_metadata(param_start_index)``).
    plan = plan_buckets(
        [1000, 130, 200],
        dp_size=2,
        bucket_size=None,
        use_distributed_optimizer=True,
        shared_embedding=[True, False, False],
    )
    assert plan.param_ranges == ((512, 1512, 1), (256, 386, 0), (0, 200, 0))
    assert [(b.offset, b.numel_unpadded, b.numel, b.param_indices) for b in plan.buckets] == [
        (0, 448, 512, (2, 1)),
        (512, 1000, 1024, (0,)),
    ]
    assert (plan.numel, plan.numel_unpadded) == (1536, 1448)


def test_shared_embedding_middle_gets_own_bucket_and_closes_right_after():
    plan = plan_buckets(
        [10, 20, 30, 40, 50],
        dp_size=1,
        bucket_size=None,
        use_distributed_optimizer=True,
        shared_embedding=[False, False, True, False, False],
    )
    # p4 @0..50, p3 @64..104 -> bucket 0 closes at pad64(104)=128, unpadded 128, numel 128.
    # p2 (embedding) @128..158 -> bucket 1 unpadded 30, numel 128.
    # p1 @256..276, p0 @320..330 -> bucket 2 unpadded 74, numel 128.
    assert plan.param_ranges == (
        (320, 330, 2),
        (256, 276, 2),
        (128, 158, 1),
        (64, 104, 0),
        (0, 50, 0),
    )
    assert [(b.offset, b.numel_unpadded, b.numel, b.param_indices) for b in plan.buckets] == [
        (0, 128, 128, (4, 3)),
        (128, 30, 128, (2,)),
        (256, 74, 128, (1, 0)),
    ]


def test_two_adjacent_shared_params_each_get_a_bucket():
    plan = plan_buckets(
        [10, 20, 30],
        dp_size=1,
        bucket_size=None,
        use_distributed_optimizer=True,
        shared_embedding=[False, True, True],
    )
    assert [b.param_indices for b in plan.buckets] == [(2,), (1,), (0,)]


def test_shared_embedding_ignored_without_distributed_optimizer():
    plan = plan_buckets(
        [10, 20, 30],
        dp_size=4,
        bucket_size=None,
        use_distributed_optimizer=False,
        shared_embedding=[False, True, False],
    )
    assert len(plan.buckets) == 1
    assert plan.param_ranges == ((50, 60, 0), (30, 50, 0), (0, 30, 0))


def test_high_nccl_busbw_padding():
    assert bucket_end_divisor(8) == 128
    assert bucket_end_divisor(8, True) == 65536
    assert bucket_end_divisor(6) == 384
    assert bucket_end_divisor(6, True) == 196608
    for dp, divisor in [(8, 65536), (6, 196608), (1, 65536)]:
        plan = plan_buckets(
            [1000, 70000],
            dp_size=dp,
            bucket_size=1,
            use_distributed_optimizer=True,
            pad_buckets_for_high_nccl_busbw=True,
        )
        assert [b.offset for b in plan.buckets] == [0, _ceil(70000, divisor)]
        assert plan.numel == _ceil(70000, divisor) + divisor
        assert all(b.numel % divisor == 0 for b in plan.buckets)
    # Without the distributed optimizer the flag does nothing (as in Megatron).
    plan = plan_buckets(
        [1000, 70000],
        dp_size=8,
        bucket_size=None,
        use_distributed_optimizer=False,
        pad_buckets_for_high_nccl_busbw=True,
    )
    assert (plan.numel, plan.numel_unpadded) == (71000, 71000)


def _ceil(n, d):
    return -(-n // d) * d


@pytest.mark.parametrize("dp_size", [3, 5, 6, 12, 96])
def test_dp_size_not_power_of_two(dp_size):
    divisor = math.lcm(dp_size, 128)
    plan = plan_buckets(
        [777, 1, 4096, 33], dp_size=dp_size, bucket_size=4000, use_distributed_optimizer=True
    )
    for b in plan.buckets:
        assert b.offset % divisor == 0 and b.numel % divisor == 0
        shards = [shard_range(b, r, dp_size) for r in range(dp_size)]
        assert shards[0][0] == b.offset and shards[-1][1] == b.end
        assert all(s[1] == t[0] for s, t in zip(shards, shards[1:]))
        assert len({e - s for s, e in shards}) == 1


def test_shard_range_and_param_shards():
    # dp=2, dist-opt: p1 (100) @ [0,100), p0 (200) @ [128,328); bucket numel 384,
    # shards [0,192) and [192,384).
    plan = plan_buckets([200, 100], dp_size=2, bucket_size=None, use_distributed_optimizer=True)
    (bucket,) = plan.buckets
    assert bucket.numel == 384
    assert shard_range(bucket, 0, 2) == (0, 192)
    assert shard_range(bucket, 1, 2) == (192, 384)
    r0 = param_shards(plan, 0, 0)
    r1 = param_shards(plan, 0, 1)
    assert [
        (
            p.param_index,
            p.buffer_start,
            p.buffer_end,
            p.shard_start,
            p.shard_end,
            p.param_start,
            p.param_end,
        )
        for p in r0
    ] == [
        (1, 0, 100, 0, 100, 0, 100),
        (0, 128, 192, 128, 192, 0, 64),
    ]
    assert [
        (
            p.param_index,
            p.buffer_start,
            p.buffer_end,
            p.shard_start,
            p.shard_end,
            p.param_start,
            p.param_end,
        )
        for p in r1
    ] == [
        (0, 192, 328, 0, 136, 64, 200),
    ]


def test_shard_range_errors():
    plan = plan_buckets([100], dp_size=3, bucket_size=None, use_distributed_optimizer=False)
    with pytest.raises(ValueError, match="100 elements, not divisible by dp_size=3"):
        shard_range(plan.buckets[0], 0, 3)
    plan = plan_buckets([100], dp_size=3, bucket_size=None, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="dp_rank must be < dp_size=3, got 3"):
        shard_range(plan.buckets[0], 3, 3)
    with pytest.raises(ValueError, match="dp_rank must be >= 0, got -1"):
        shard_range(plan.buckets[0], -1, 3)
    with pytest.raises(ValueError, match=r"bucket_id must be in \[0, 1\), got 1"):
        param_shards(plan, 1, 0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(numels=[10, 0]), r"numels\[1\] must be >= 1, got 0"),
        (dict(numels=[-5]), r"numels\[0\] must be >= 1, got -5"),
        (dict(numels=[2.5]), r"numels\[0\] must be an integer, got 2.5"),
        (dict(numels=[]), "at least one parameter"),
        (dict(dp_size=0), "dp_size must be >= 1, got 0"),
        (dict(bucket_size=0), "bucket_size must be >= 1, got 0"),
        (dict(bucket_size=-3), "bucket_size must be >= 1, got -3"),
        (dict(shared_embedding=[True]), "shared_embedding has 1 flags but numels has 2"),
    ],
)
def test_validation(kwargs, match):
    args = dict(numels=[10, 20], dp_size=2, bucket_size=None, use_distributed_optimizer=True)
    args.update(kwargs)
    numels = args.pop("numels")
    with pytest.raises(ValueError, match=match):
        plan_buckets(numels, **args)


def test_accepts_numpy_integers_and_is_frozen():
    plan = plan_buckets(
        np.array([3, 4], dtype=np.int64),
        dp_size=np.int32(2),
        bucket_size=None,
        use_distributed_optimizer=True,
    )
    assert plan.param_ranges == ((64, 67, 0), (0, 4, 0))
    assert all(type(x) is int for r in plan.param_ranges for x in r)
    with pytest.raises(AttributeError):
        plan.numel = 0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        plan.buckets[0].offset = 1  # type: ignore[misc]
    assert isinstance(plan, BucketPlan)
    assert hash(plan) == hash(
        plan_buckets([3, 4], dp_size=2, bucket_size=None, use_distributed_optimizer=True)
    )


def test_summary_and_padding_fraction():
    plan = plan_buckets([1000], dp_size=8, bucket_size=None, use_distributed_optimizer=True)
    assert plan.padding_fraction == pytest.approx(24 / 1024)
    text = plan.summary()
    assert "1 bucket(s)" in text and "padding 24 (2.34%)" in text
    assert "bucket 0: offset 0, 1 params, 1000 unpadded, 1024 padded" in text


# ----------------------------------------------------------------------------------------
# Randomized invariants, checked against definitions rather than the implementation.
# ----------------------------------------------------------------------------------------


def _check_invariants(numels, shared, plan: BucketPlan, *, dp, bucket_size, use_do, high):
    n = len(numels)
    divisor = math.lcm(dp, 128, 2**16) if high else math.lcm(dp, 128)
    own = [bool(s) and use_do for s in shared]
    # Buffer order is reverse registration order; params never overlap.
    order = [k for b in plan.buckets for k in b.param_indices]
    assert order == list(range(n - 1, -1, -1))
    for k in range(n):
        start, end, bid = plan.param_ranges[k]
        assert end - start == numels[k]
        assert k in plan.buckets[bid].param_indices
        if k + 1 < n:
            assert start >= plan.param_ranges[k + 1][1]
            if not use_do:
                assert start == plan.param_ranges[k + 1][1]  # packed, no padding
        if use_do:
            assert start % 64 == 0
    # Buckets tile the buffer; params lie inside their bucket's unpadded part.
    assert plan.buckets[0].offset == 0
    for i, b in enumerate(plan.buckets):
        assert b.bucket_id == i and b.param_indices
        if i + 1 < len(plan.buckets):
            assert b.end == plan.buckets[i + 1].offset
        last_end = max(plan.param_ranges[k][1] for k in b.param_indices)
        assert min(plan.param_ranges[k][0] for k in b.param_indices) >= b.offset
        assert last_end - b.offset <= b.numel_unpadded <= b.numel
        if use_do:
            assert b.offset % divisor == 0 and b.numel % divisor == 0
            # Unpadded size is the last end, except when a shared parameter closed the bucket
            # early: then it is the 64-aligned start of that parameter.
            assert b.numel_unpadded in (last_end - b.offset, _ceil(last_end, 64) - b.offset)
        else:
            assert b.numel == b.numel_unpadded == last_end - b.offset
        # Closing rule: every param but the bucket's last left the span < bucket_size and is
        # not a shared embedding; a shared embedding is alone.
        for k in b.param_indices[:-1]:
            assert not own[k]
            if bucket_size is not None:
                assert plan.param_ranges[k][1] - b.offset < bucket_size
        if any(own[k] for k in b.param_indices):
            assert len(b.param_indices) == 1
        # A bucket that is not the last closed for a reason.
        if i + 1 < len(plan.buckets):
            k_last = b.param_indices[-1]
            k_next = plan.buckets[i + 1].param_indices[0]
            reached = bucket_size is not None and last_end - b.offset >= bucket_size
            assert reached or own[k_last] or own[k_next]
    assert plan.numel == plan.buckets[-1].end
    assert plan.numel_unpadded == sum(b.numel_unpadded for b in plan.buckets)
    assert plan.param_numel == sum(numels)
    if use_do:
        assert plan.numel % dp == 0
        # Every parameter element is owned by exactly one rank.
        covered = np.zeros(plan.numel, dtype=np.int32)
        for b in plan.buckets:
            for r in range(dp):
                lo, hi = shard_range(b, r, dp)
                assert hi - lo == b.numel // dp
                for p in param_shards(plan, b.bucket_id, r):
                    s, e, _ = plan.param_ranges[p.param_index]
                    assert lo <= p.buffer_start < p.buffer_end <= hi
                    assert (p.param_start, p.param_end) == (p.buffer_start - s, p.buffer_end - s)
                    assert (p.shard_start, p.shard_end) == (p.buffer_start - lo, p.buffer_end - lo)
                    covered[p.buffer_start : p.buffer_end] += 1
        expected = np.zeros(plan.numel, dtype=np.int32)
        for s, e, _ in plan.param_ranges:
            expected[s:e] = 1
        np.testing.assert_array_equal(covered, expected)


def test_random_invariants():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 12)
        numels = [rng.choice([1, 63, 64, 65, 128, rng.randint(1, 5000)]) for _ in range(n)]
        shared = [rng.random() < 0.15 for _ in range(n)]
        dp = rng.choice([1, 2, 3, 4, 6, 8, 12, 16])
        bucket_size = rng.choice([None, 1, rng.randint(1, 20000)])
        use_do = rng.random() < 0.7
        high = rng.random() < 0.2
        plan = plan_buckets(
            numels,
            dp_size=dp,
            bucket_size=bucket_size,
            use_distributed_optimizer=use_do,
            pad_buckets_for_high_nccl_busbw=high,
            shared_embedding=shared,
        )
        _check_invariants(
            numels, shared, plan, dp=dp, bucket_size=bucket_size, use_do=use_do, high=high
        )
        # Without shared embeddings the layout also matches Megatron's test gold values.
        if bucket_size is not None and not high:
            plan = plan_buckets(
                numels, dp_size=dp, bucket_size=bucket_size, use_distributed_optimizer=use_do
            )
            unpadded, padded = _megatron_gold(numels, bucket_size, use_do, False, dp)
            assert [b.numel_unpadded for b in plan.buckets] == unpadded
            assert [b.numel for b in plan.buckets] == padded


# ----------------------------------------------------------------------------------------
# A small GPT (2 layers, hidden 128, vocab 256, seq 128).
# ----------------------------------------------------------------------------------------


def gpt_numels(num_layers=2, hidden=128, vocab=256, seq=128):
    numels = [vocab * hidden, seq * hidden]
    for _ in range(num_layers):
        numels += [hidden, hidden]  # input layernorm
        numels += [3 * hidden * hidden, 3 * hidden]  # qkv
        numels += [hidden * hidden, hidden]  # attention proj
        numels += [hidden, hidden]  # pre-MLP layernorm
        numels += [4 * hidden * hidden, 4 * hidden]  # fc1
        numels += [hidden * 4 * hidden, hidden]  # fc2
    numels += [hidden, hidden]  # final layernorm
    return numels


@pytest.mark.parametrize("bucket_size", [40000, None])
def test_small_gpt_layout(bucket_size):
    numels = gpt_numels()
    assert sum(numels) == 32768 + 16384 + 2 * (4 * 128 + 49536 + 16512 + 66048 + 65664) + 256
    plan = plan_buckets(numels, dp_size=8, bucket_size=bucket_size, use_distributed_optimizer=True)
    _check_invariants(
        numels, [False] * len(numels), plan, dp=8, bucket_size=bucket_size, use_do=True, high=False
    )
    # Every size here is a multiple of 128, so nothing is padded. With bucket_size=40000,
    # backprop order gives: [final ln x2, fc2 b, fc2 w] = 65920; [fc1 b, fc1 w] = 66048;
    # [ln2 x2, proj b, proj w, qkv b, qkv w] = 66304; the same for layer 0 (the first of
    # them picking up layer 1's ln1 x2: 65920); last [ln1 x2, positions, embedding] = 49408.
    if bucket_size is None:
        expected = [445952]
    else:
        expected = [65920, 66048, 66304, 65920, 66048, 66304, 49408]
    assert [b.numel for b in plan.buckets] == expected
    assert [b.numel_unpadded for b in plan.buckets] == expected
    assert plan.padding == 0 and plan.padding_fraction == 0.0
    # Hidden 100 (not a multiple of 64) does pad.
    odd = gpt_numels(hidden=100, vocab=257, seq=100)
    plan = plan_buckets(odd, dp_size=8, bucket_size=bucket_size, use_distributed_optimizer=True)
    _check_invariants(
        odd, [False] * len(odd), plan, dp=8, bucket_size=bucket_size, use_do=True, high=False
    )
    assert 0 < plan.padding_fraction < 0.01
