"""Tests for the example-weighted mean over the client axis, and for `aggregate`, the server's
whole aggregation step around it (validation, robust rules, norm bound, client-level DP)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_split.errors import UserError
from fedjax_split.fed import aggregation, privacy
from fedjax_split.fed.aggregation import (
    Aggregated,
    Aggregator,
    aggregate,
    aggregate_each,
    tampered,
    weighted_mean,
)


def test_weighted_mean_is_weighted_and_over_client_axis_only() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 2)).astype(np.float32)  # distinct per client
    n = np.array([10, 30, 60], np.int32)
    out = np.asarray(weighted_mean({"a": {"x": x}}, n)["a"]["x"])
    want = (10 * x[0].astype(np.float64) + 30 * x[1] + 60 * x[2]) / 100
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)
    assert out.shape == (4, 2)
    unweighted = x.mean(axis=0)
    all_axis = np.full((4, 2), x.mean())
    assert np.abs(out - unweighted).max() > 1e-2
    assert np.abs(out - all_axis).max() > 1e-2


def test_weighted_mean_in_fp32_from_16_bit_leaves() -> None:
    # 2049 is not representable in fp16; an fp16 accumulation would give 2048 or 2050.
    x = np.array([[2048.0], [2050.0]], np.float16)
    out = weighted_mean({"x": jnp.asarray(x)}, np.array([1, 1]))["x"]
    assert out.dtype == jnp.float32
    assert float(out[0]) == 2049.0


def test_zero_weight_clients_do_not_count() -> None:
    x = np.array([[1.0, 2.0], [5.0, 7.0], [1e6, -1e6]], np.float32)
    out = weighted_mean({"x": x}, np.array([1.0, 3.0, 0.0]))["x"]
    np.testing.assert_allclose(np.asarray(out), [4.0, 5.75], rtol=1e-7)


def test_empty_tree() -> None:
    assert weighted_mean({}, np.array([1, 2])) == {}


# `aggregate`: the server's whole aggregation step. Jitted as the rounds jit it (eager, it would
# run op by op); `aggregator` is static.
AGGREGATE = jax.jit(aggregate, static_argnums=0)


def _each(aggregator: Aggregator, stacked: dict, *args) -> Aggregated:
    """`aggregate_each` of the rows of `stacked`, one tree per client."""
    k = len(jax.tree.leaves(stacked)[0])
    trees = [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(k)]
    return jax.jit(aggregate_each, static_argnums=0)(aggregator, trees, *args)


def _both(aggregator: Aggregator, stacked: dict, received: dict, weights: np.ndarray, state,
          key: jax.Array, reported=None, factors=None) -> Aggregated:  # fmt: skip
    """`aggregate` of the stacked uploads, after checking that `aggregate_each` of the same
    uploads one tree per client gives the same result: bit for bit where it stacks them (every
    rule but the plain mean); the plain mean's sum where they lie may round differently (XLA
    fuses it into multiply-adds of its own choosing), within an fp32 rounding or two."""
    args = (received, weights, state, key, reported, factors)
    a = AGGREGATE(aggregator, stacked, *args)
    b = _each(aggregator, stacked, *args)
    if aggregator.plain and factors is None:  # strict: dtypes and shapes equal too
        chex.assert_trees_all_close(a, b, rtol=3e-7, atol=3e-7, strict=True)
    else:
        chex.assert_trees_all_equal(a, b, strict=True)
    return a


# Four clients over two leaves; their updates (upload - received) are small integers, distinct per
# client and per coordinate, so every mean below is exact in fp32 and easy to follow by hand.
REC = {"a": np.array([10.0, 20.0, 30.0], np.float32), "b": np.array([[1.0], [-1.0]], np.float32)}
DA = np.array([[1, -2, 4], [3, 6, -8], [-5, 2, 0], [7, 4, 12]], np.float32)
DB = np.array([[[2], [0]], [[-4], [6]], [[1], [1]], [[3], [-3]]], np.float32)
UPS = {"a": REC["a"] + DA, "b": REC["b"] + DB}
KEY = jax.random.key(0)


def _close(tree: dict, a: list, b: list, rtol: float = 1e-6) -> None:
    np.testing.assert_allclose(np.asarray(tree["a"]), a, rtol=rtol, atol=1e-6)
    np.testing.assert_allclose(np.asarray(tree["b"]), b, rtol=rtol, atol=1e-6)
    assert tree["a"].dtype == tree["b"].dtype == jnp.float32


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_upload_is_left_out_and_the_others_reweighted(bad: float) -> None:
    ups = jax.tree.map(np.copy, UPS)
    ups["b"][2, 1, 0] = bad  # one coordinate of one leaf of client 2
    w = np.array([1.0, 2.0, 3.0, 4.0])
    out = _both(Aggregator(), ups, REC, w, (), KEY)
    np.testing.assert_array_equal(np.asarray(out.valid), [True, True, False, True])
    # the example-weighted mean of clients 0, 1, 3 (weights 1, 2, 4 of 7)
    _close(out.mean, REC["a"] + (DA[0] + 2 * DA[1] + 4 * DA[3]) / 7,
           REC["b"] + (DB[0] + 2 * DB[1] + 4 * DB[3]) / 7)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.norms), np.zeros(4))  # not measured
    # the robust rules and the norm bound leave it out too (its norm is reported as 0)
    out = _both(Aggregator(rule="median"), ups, REC, w, (), KEY)
    np.testing.assert_array_equal(np.asarray(out.valid), [True, True, False, True])
    # clients 0, 1, 3: a's columns [1, 3, 7], [-2, 4, 6], [-8, 4, 12]; b's [-4, 2, 3], [-3, 0, 6]
    _close(out.mean, REC["a"] + [3, 4, 4], REC["b"] + [[2], [0]])
    assert float(out.norms[2]) == 0.0 and np.all(np.isfinite(np.asarray(out.norms)))


def test_when_every_upload_is_bad_the_mean_is_the_copy_received() -> None:
    ups = jax.tree.map(np.copy, UPS)
    ups["a"][[0, 2], 1] = np.nan
    ups["b"][[1, 3], 0, 0] = np.inf
    w = np.array([1.0, 2.0, 3.0, 4.0])
    for aggregator in (Aggregator(), Aggregator(rule="trimmed-mean", trim_fraction=0.25),
                       Aggregator(rule="median"), Aggregator(max_update_norm=1.0)):  # fmt: skip
        out = _both(aggregator, ups, REC, w, (), KEY)
        assert not np.any(np.asarray(out.valid))
        np.testing.assert_array_equal(np.asarray(out.mean["a"]), REC["a"])
        np.testing.assert_array_equal(np.asarray(out.mean["b"]), REC["b"])


def test_trimmed_mean_and_median_of_the_updates_by_hand() -> None:
    # a fifth, weight-0 client (padding) with a huge update must not count
    ups = {k: np.concatenate([v, REC[k][None] + 1e6]) for k, v in UPS.items()}
    w = np.array([1.0, 1.0, 50.0, 1.0, 0.0])  # unweighted rules: client 2's 50 changes nothing
    # per coordinate over clients 0..3, sorted: a [-5,1,3,7], [-2,2,4,6], [-8,0,4,12];
    # b [-4,1,2,3], [-3,0,1,6]; the median is the mean of the middle two
    out = _both(Aggregator(rule="median"), ups, REC, w, (), KEY)
    _close(out.mean, REC["a"] + [2, 3, 2], REC["b"] + [[1.5], [0.5]])
    np.testing.assert_array_equal(np.asarray(out.valid), [True] * 5)  # finite, just weight 0
    # k = 4, trim 0.25: t = 1, the middle two again; trim 0.2: t = 0, the plain unweighted mean
    out = _both(Aggregator(rule="trimmed-mean", trim_fraction=0.25), ups, REC, w, (), KEY)
    _close(out.mean, REC["a"] + [2, 3, 2], REC["b"] + [[1.5], [0.5]])
    out = _both(Aggregator(rule="trimmed-mean", trim_fraction=0.2), ups, REC, w, (), KEY)
    _close(out.mean, REC["a"] + [6 / 4, 10 / 4, 8 / 4], REC["b"] + [[2 / 4], [4 / 4]])
    # the rules report each update's norm: client 0's is sqrt(1 + 4 + 16 + 4 + 0) = 5
    norms = np.sqrt((DA.astype(np.float64) ** 2).sum(1) + (DB.astype(np.float64) ** 2).sum((1, 2)))
    np.testing.assert_allclose(np.asarray(out.norms), [*norms, 0.0], rtol=1e-6)
    assert norms[0] == 5.0


def test_max_update_norm_clips_each_update_before_the_weighted_mean() -> None:
    rec = {"x": np.array([1.0, 1.0], np.float32)}
    # updates (3, 4) of norm 5 and (0.6, 0.8) of norm 1; bound 2: (1.2, 1.6) and (0.6, 0.8)
    ups = {"x": rec["x"] + np.array([[3.0, 4.0], [0.6, 0.8]], np.float32)}
    out = _both(Aggregator(max_update_norm=2.0), ups, rec, np.array([1.0, 3.0]), (), KEY)
    # example-weighted 1:3: (1.2 + 1.8) / 4, (1.6 + 2.4) / 4
    np.testing.assert_allclose(np.asarray(out.mean["x"]), [1.75, 2.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out.norms), [5.0, 1.0], rtol=1e-6)  # before clipping
    # with the median: the two clipped updates' middle, (0.9, 1.2)
    out = _both(Aggregator(rule="median", max_update_norm=2.0), ups, rec, np.array([1.0, 3.0]),
                (), KEY)  # fmt: skip
    np.testing.assert_allclose(np.asarray(out.mean["x"]), [1.9, 2.2], rtol=1e-6)


def test_dp_without_noise_or_clipping_is_the_uniform_mean() -> None:
    dp = privacy.DPSpec(clip=1e6, noise_multiplier=0.0, denominator=4.0)
    state = privacy.init_state(dp)
    w = np.array([1.0, 2.0, 3.0, 4.0])  # ignored: DP weighs every client alike
    out = _both(Aggregator(dp=dp), UPS, REC, w, state, KEY)
    _close(out.mean, REC["a"] + DA.sum(0) / 4, REC["b"] + DB.sum(0) / 4)
    uniform = weighted_mean(UPS, np.ones(4))
    chex.assert_trees_all_close(out.mean, uniform, rtol=1e-6, atol=1e-6)
    weighted = weighted_mean(UPS, w)
    assert np.abs(np.asarray(out.mean["a"]) - np.asarray(weighted["a"])).max() > 0.5
    assert float(out.state["clip"]) == 1e6  # a fixed clip norm
    # the denominator is the expected clients a round, not those who came: 8 halves the step
    half = privacy.DPSpec(clip=1e6, noise_multiplier=0.0, denominator=8.0)
    out = _both(Aggregator(dp=half), UPS, REC, w, state, KEY)
    _close(out.mean, REC["a"] + DA.sum(0) / 8, REC["b"] + DB.sum(0) / 8)


def test_dp_clips_with_the_states_clip_norm_and_counts_the_reported_norms() -> None:
    dp = privacy.DPSpec(clip=1.0, noise_multiplier=0.0, denominator=2.0, target_quantile=0.5,
                        count_stddev=0.5)  # fmt: skip
    rec = {"x": np.zeros(2, np.float32)}
    ups = {"x": np.array([[3.0, 4.0], [0.0, 0.5], [6.0, 8.0]], np.float32)}  # norms 5, 0.5, 10
    w = np.array([1.0, 1.0, 0.0])  # client 2: padding
    state = {"clip": jnp.float32(2.5)}  # this round's clip norm, not the spec's first one
    reported = np.array([5.0, 3.0, 0.1], np.float32)  # the clients' own norms before clipping
    out = _both(Aggregator(dp=dp), ups, rec, w, state, KEY, reported)
    # (3, 4) clipped to 2.5: (1.5, 2); plus (0, 0.5); over 2
    np.testing.assert_allclose(np.asarray(out.mean["x"]), [0.75, 1.25], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out.norms), [5.0, 3.0, 0.0], rtol=1e-6)
    # the next clip norm counts the reported norms within 2.5 (none of the real clients') with
    # the count noise from the second half of the server's key
    deviate = float(jax.random.normal(jax.random.split(KEY)[1], (), jnp.float32))
    b = (0 + 0.5 * deviate) / 2
    assert float(out.state["clip"]) == pytest.approx(2.5 * np.exp(-0.2 * (b - 0.5)), rel=1e-6)


def test_dp_noise_on_the_aggregate() -> None:
    """Every client's update zero: the step is the noise alone, std z C / M, from the key."""
    dp = privacy.DPSpec(clip=0.4, noise_multiplier=1.5, denominator=5.0)
    rec = {"big": np.linspace(-1, 1, 200_000).astype(np.float32), "s": np.zeros(3, np.float32)}
    ups = jax.tree.map(lambda r: np.stack([r] * 3), rec)
    out = AGGREGATE(Aggregator(dp=dp), ups, rec, np.ones(3), privacy.init_state(dp), KEY)
    noise = np.asarray(out.mean["big"], np.float64) - rec["big"]
    assert noise.std() == pytest.approx(1.5 * 0.4 / 5, rel=0.02)
    assert abs(noise.mean()) < 5 * 0.12 / np.sqrt(200_000)
    again = AGGREGATE(Aggregator(dp=dp), ups, rec, np.ones(3), privacy.init_state(dp), KEY)
    np.testing.assert_array_equal(np.asarray(again.mean["big"]), np.asarray(out.mean["big"]))
    other = AGGREGATE(Aggregator(dp=dp), ups, rec, np.ones(3), privacy.init_state(dp),
                      jax.random.key(1))  # fmt: skip
    assert not np.any(np.asarray(other.mean["s"]) == np.asarray(out.mean["s"]))


def test_nobody_under_dp_is_the_noise_alone_and_without_dp_no_step() -> None:
    dp = privacy.DPSpec(clip=0.4, noise_multiplier=1.5, denominator=5.0)
    rec = {"big": np.zeros(100_000, np.float32)}
    empty = {"big": np.zeros((0, 100_000), np.float32)}
    out = AGGREGATE(Aggregator(dp=dp), empty, rec, np.zeros(0), privacy.init_state(dp), KEY)
    assert out.valid.shape == out.norms.shape == (0,)
    assert np.asarray(out.mean["big"]).std() == pytest.approx(0.12, rel=0.03)
    each = jax.jit(aggregate_each, static_argnums=0)(Aggregator(dp=dp), [], rec, np.zeros(0),
                                                     privacy.init_state(dp), KEY)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(each.mean["big"]), np.asarray(out.mean["big"]))
    plain = AGGREGATE(Aggregator(), empty, rec, np.zeros(0), (), KEY)
    np.testing.assert_array_equal(np.asarray(plain.mean["big"]), rec["big"])


@pytest.mark.parametrize(
    "aggregator",
    [
        Aggregator(),
        Aggregator(rule="trimmed-mean", trim_fraction=0.25),
        Aggregator(rule="median"),
        Aggregator(max_update_norm=3.0),
        Aggregator(dp=privacy.DPSpec(clip=5.0, noise_multiplier=0.8, denominator=4.0)),
        Aggregator(dp=privacy.DPSpec(clip=5.0, noise_multiplier=0.1, denominator=4.0,
                                     target_quantile=0.5)),
    ],
    ids=["mean", "trimmed-mean", "median", "max-norm", "dp", "dp-adaptive"],
)  # fmt: skip
def test_stacked_and_one_tree_per_client_agree(aggregator: Aggregator) -> None:
    rng = np.random.default_rng(5)
    ups = {"a": rng.standard_normal((4, 3, 2)).astype(np.float32),
           "b": rng.standard_normal((4, 5)).astype(np.float32)}  # fmt: skip
    ups["a"][1, 0, 0] = np.nan  # one rejected upload
    rec = {"a": rng.standard_normal((3, 2)).astype(np.float32),
           "b": rng.standard_normal(5).astype(np.float32)}  # fmt: skip
    state = aggregation.init_state(aggregator)
    w = np.array([3.0, 1.0, 7.0, 2.0])
    out = _both(aggregator, ups, rec, w, state, KEY)  # checks the two agree
    np.testing.assert_array_equal(np.asarray(out.valid), [True, False, True, True])
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(out.mean))
    flips = np.array([1.0, 1.0, -1.0, 1.0], np.float32)
    _both(aggregator, ups, rec, w, state, KEY, None, flips)


def test_tampered_updates() -> None:
    rec = {"x": np.array([1.0, -2.0], np.float32)}
    ups = {"x": np.array([[1.5, -1.0], [0.1, 0.2], [3.0, -3.0]], np.float32)}
    out = tampered(ups, rec, np.array([1.0, -1.0, 100.0], np.float32))
    np.testing.assert_array_equal(np.asarray(out["x"][0]), ups["x"][0])  # untouched, bit for bit
    # client 1: update (-0.9, 2.2) flipped to (0.9, -2.2); client 2: (2, -1) times 100
    np.testing.assert_allclose(np.asarray(out["x"][1]), [1.9, -4.2], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["x"][2]), [201.0, -102.0], rtol=1e-6)
    # aggregate's factors are that attack, applied before anything else (the median here)
    by_hand = AGGREGATE(Aggregator(rule="median"), out, rec, np.ones(3), (), KEY)
    attacked = AGGREGATE(Aggregator(rule="median"), ups, rec, np.ones(3), (), KEY, None,
                         np.array([1.0, -1.0, 100.0], np.float32))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(attacked.mean["x"]), np.asarray(by_hand.mean["x"]))
    np.testing.assert_allclose(np.asarray(attacked.mean["x"]), [1.9, -4.2], rtol=1e-6)


def test_init_state() -> None:
    assert aggregation.init_state(Aggregator(rule="median")) == ()
    dp = privacy.DPSpec(clip=0.3, noise_multiplier=1.0, denominator=2.0)
    assert float(aggregation.init_state(Aggregator(dp=dp))["clip"]) == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"rule": "mode"}, "unknown --aggregator 'mode'"),
        ({"trim_fraction": 0.6}, "--trim-fraction must be in [0, 0.5)"),
        ({"max_update_norm": 0.0}, "--max-update-norm must be > 0"),
        ({"rule": "median", "dp": privacy.DPSpec(clip=1.0, noise_multiplier=1.0,
                                                 denominator=1.0)}, "--aggregator median with DP"),
    ],
)  # fmt: skip
def test_bad_aggregators_are_one_line_user_errors(kwargs: dict, needle: str) -> None:
    with pytest.raises(UserError) as info:
        Aggregator(**kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)
