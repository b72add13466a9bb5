"""Tests for client-level DP's pieces (fed/privacy.py): clipping at the client, the server's
Gaussian noise and its keys, adaptive clipping, the settings' checks. Expected values are worked
out by hand or with numpy in float64; the noise is checked statistically over many draws."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fedjax_split.errors import UserError
from fedjax_split.fed import aggregation, privacy
from fedjax_split.fed.privacy import DPSpec

F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")
CLIP = jax.jit(privacy.clip_upload, static_argnames="wire")
AGGREGATE = jax.jit(aggregation.aggregate, static_argnums=0)  # eager, it runs op by op


def _norm64(tree_a: dict, tree_b: dict) -> float:
    """The L2 norm of a - b over every leaf, in float64."""
    return math.sqrt(sum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
                         for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b),
                                         strict=True)))  # fmt: skip


# a received copy and an upload whose update is (3, 4 | 12) over two leaves: norm 13
RECEIVED = {"a": np.array([0.5, -1.25], np.float32), "b": {"c": np.array([[2.0]], np.float32)}}
UPLOAD = {"a": np.array([3.5, 2.75], np.float32), "b": {"c": np.array([[14.0]], np.float32)}}


def test_clip_upload_scales_an_update_over_the_bound_to_the_bound() -> None:
    clipped, norm = privacy.clip_upload(UPLOAD, RECEIVED, jnp.float32(6.5), F32)
    assert norm.dtype == jnp.float32 and float(norm) == 13.0  # the norm before clipping
    # 6.5 / 13 = 1/2 of the update (1.5, 2 | 6) on top of the received copy
    np.testing.assert_array_equal(np.asarray(clipped["a"]), [2.0, 0.75])
    np.testing.assert_array_equal(np.asarray(clipped["b"]["c"]), [[8.0]])
    assert clipped["a"].dtype == jnp.float32


def test_clip_upload_bounds_the_norm_of_a_random_update() -> None:
    rng = np.random.default_rng(3)
    received = {"w": rng.standard_normal((7, 5)).astype(np.float32),
                "v": rng.standard_normal(11).astype(np.float32)}  # fmt: skip
    upload = jax.tree.map(lambda r: r + rng.standard_normal(r.shape).astype(np.float32), received)
    before = _norm64(upload, received)
    assert before > 3  # 46 normal deviates: the bound below clips
    for bound in (0.01, 0.7, 3.0):
        clipped, norm = privacy.clip_upload(upload, received, jnp.float32(bound), F32)
        np.testing.assert_allclose(float(norm), before, rtol=1e-6)
        after = _norm64(clipped, received)
        assert after <= bound * (1 + 1e-6)
        assert after == pytest.approx(bound, rel=1e-5)  # scaled down to it, not below
        # the direction is kept: the clipped update is the update times bound / norm
        want = jax.tree.map(lambda u, r, b=bound: r + (u.astype(np.float64) - r) * b / before,
                            upload, received)  # fmt: skip
        chex.assert_trees_all_close(clipped, want, rtol=1e-6, atol=1e-6)


def test_an_update_within_the_bound_is_sent_bit_for_bit() -> None:
    # values whose difference and sum round: received + (upload - received) != upload in fp32
    received = {"x": np.array([1.0, 0.1, 3.0], np.float32)}
    upload = {"x": np.array([1e-8, 0.3, 2.9], np.float32)}
    assert not np.array_equal(received["x"] + (upload["x"] - received["x"]), upload["x"])
    norm = math.sqrt(float(np.sum((upload["x"].astype(np.float64) - received["x"]) ** 2)))
    for bound in (10.0, 1.1, norm * (1 + 1e-6)):
        clipped, got = privacy.clip_upload(upload, received, jnp.float32(bound), F32)
        np.testing.assert_array_equal(np.asarray(clipped["x"]), upload["x"])
        np.testing.assert_allclose(float(got), norm, rtol=1e-6)


def test_a_16_bit_wire_rounds_the_clipped_upload_and_the_server_clips_again() -> None:
    """bf16 rounding of the clipped upload can lift its update's norm past the bound; what the
    server sums (aggregate, DP with z = 0 over one client) is bounded all the same."""
    bound = 0.2
    for seed in range(200):  # a case where the rounding lifts the norm (about one in ten)
        rng = np.random.default_rng(seed)
        received = rng.standard_normal(8).astype(ml_dtypes.bfloat16).astype(np.float32)
        upload = (received + 0.3 * rng.standard_normal(8)).astype(ml_dtypes.bfloat16)
        upload = upload.astype(np.float32)
        clipped, norm = CLIP(upload={"x": upload}, received={"x": received},
                             bound=jnp.float32(bound), wire=BF16)
        if _norm64(clipped, {"x": received}) > bound * (1 + 1e-3):
            break
    else:
        pytest.fail("no seed whose bf16 rounding lifts the clipped norm past the bound")
    c = np.asarray(clipped["x"])
    assert c.dtype == np.float32
    np.testing.assert_array_equal(c.astype(ml_dtypes.bfloat16).astype(np.float32), c)  # on the wire
    np.testing.assert_allclose(float(norm), _norm64({"x": upload}, {"x": received}), rtol=1e-6)
    spec = DPSpec(clip=bound, noise_multiplier=0.0, denominator=1.0)
    agg = AGGREGATE(
        aggregation.Aggregator(dp=spec), {"x": c[None]}, {"x": received}, np.ones(1),
        privacy.init_state(spec), jax.random.key(0), norm[None],
    )  # fmt: skip
    assert _norm64(agg.mean, {"x": received}) <= bound * (1 + 1e-6)
    # ... and clipping again only scaled it: the direction is the clipped upload's
    direction = (c.astype(np.float64) - received) / _norm64(clipped, {"x": received})
    np.testing.assert_allclose(np.asarray(agg.mean["x"]), received + bound * direction,
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def test_global_norm_is_fp32_over_every_leaf() -> None:
    tree = {"a": jnp.asarray([3.0, 4.0], jnp.bfloat16), "b": [jnp.asarray([[12.0]], jnp.float32)]}
    out = privacy.global_norm(tree)
    assert out.dtype == jnp.float32 and float(out) == 13.0
    assert float(privacy.global_norm({})) == 0.0


def _noise_std(spec: DPSpec, clip: float, n: int, key: jax.Array) -> tuple[np.ndarray, ...]:
    """noised_mean of a zero sum: two leaves of n/2 values each (pure noise / denominator)."""
    zeros = {"p": jnp.zeros((n // 2,), jnp.float32), "q": jnp.zeros((n // 4, 2), jnp.float32)}
    out = privacy.noised_mean(spec, zeros, jnp.float32(clip), key)
    assert out["p"].dtype == jnp.float32 and out["q"].shape == (n // 4, 2)
    return np.asarray(out["p"], np.float64), np.asarray(out["q"], np.float64).reshape(-1)


@pytest.mark.parametrize(
    ("spec", "clip", "want"),
    [
        # fixed clip: std z C / M
        (DPSpec(clip=0.5, noise_multiplier=1.3, denominator=4.0), 0.5, 1.3 * 0.5 / 4),
        # the round's clip norm (the state's) sets the noise, not the first round's
        (DPSpec(clip=0.5, noise_multiplier=1.3, denominator=4.0), 2.0, 1.3 * 2.0 / 4),
        # adaptive: sigma_b = 40 / 20 = 2, z_delta = (1 - 1/16)^-1/2
        (DPSpec(clip=1.0, noise_multiplier=1.0, denominator=40.0, target_quantile=0.5), 3.0,
         3.0 / math.sqrt(1 - 1 / 16) / 40),
    ],
)  # fmt: skip
def test_noise_on_the_mean_has_std_z_clip_over_the_denominator(spec, clip, want) -> None:
    n = 400_000
    p, q = _noise_std(spec, clip, n, jax.random.key(7))
    x = np.concatenate([p, q])
    # the sample std of n normal deviates is within 3 / sqrt(2 n) = 0.34% of the true one
    assert x.std() == pytest.approx(want, rel=0.01)
    assert abs(x.mean()) < 5 * want / math.sqrt(n)
    # a fourth moment of 3 sigma^4: Gaussian, not e.g. uniform noise of the same std
    assert np.mean(x**4) / x.var() ** 2 == pytest.approx(3.0, rel=0.05)
    # each leaf draws its own noise: the two halves are uncorrelated, not copies
    assert abs(np.corrcoef(p, q)[0, 1]) < 0.02


def test_no_noise_with_a_zero_multiplier() -> None:
    spec = DPSpec(clip=1.0, noise_multiplier=0.0, denominator=5.0)
    out = privacy.noised_mean(spec, {"x": jnp.asarray([10.0, -5.0])}, jnp.float32(1.0),
                              jax.random.key(0))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out["x"]), [2.0, -1.0])


def test_the_same_key_gives_the_same_noise_and_another_key_other_noise() -> None:
    spec = DPSpec(clip=1.0, noise_multiplier=1.0, denominator=1.0)
    zeros = {"x": jnp.zeros((1000,), jnp.float32)}
    draw = lambda key: np.asarray(privacy.noised_mean(spec, zeros, jnp.float32(1.0), key)["x"])  # noqa: E731
    a, b = draw(jax.random.key(1)), draw(jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    c = draw(jax.random.key(2))
    assert np.abs(np.corrcoef(a, c)[0, 1]) < 0.15 and not np.any(a == c)


def test_update_noise_multiplier_by_hand() -> None:
    assert DPSpec(clip=1.0, noise_multiplier=0.7, denominator=3.0).update_noise_multiplier == 0.7
    # sigma_b = 20 / 20 = 1: z_delta = (0.5^-2 - 2^-2)^-1/2 = 3.75^-1/2
    spec = DPSpec(clip=1.0, noise_multiplier=0.5, denominator=20.0, target_quantile=0.5)
    assert spec.sigma_b == 1.0
    assert spec.update_noise_multiplier == pytest.approx(1 / math.sqrt(3.75), rel=1e-12)
    # an explicit count noise: sigma_b = 4, z_delta = (1 - 1/64)^-1/2
    spec = DPSpec(clip=1.0, noise_multiplier=1.0, denominator=5.0, target_quantile=0.3,
                  count_stddev=4.0)  # fmt: skip
    assert spec.sigma_b == 4.0
    assert spec.update_noise_multiplier == pytest.approx((1 - 1 / 64) ** -0.5, rel=1e-12)
    assert spec.update_noise_multiplier > 1.0  # the updates' share is noisier than z
    zero = DPSpec(clip=1.0, noise_multiplier=0.0, denominator=20.0, target_quantile=0.5)
    assert zero.update_noise_multiplier == 0.0


def test_next_clip_by_hand() -> None:
    spec = DPSpec(clip=1.0, noise_multiplier=0.1, denominator=4.0, target_quantile=0.5)
    assert spec.sigma_b == 0.2 and spec.clip_learning_rate == 0.2
    # clients 0 and 3 within the bound 1.0 (3 exactly at it); 1 over; 4 within but invalid
    norms = np.array([0.5, 1.5, 2.5, 1.0, 0.1], np.float32)
    valid = np.array([True, True, True, True, False])
    key = jax.random.key(3)
    got = float(privacy.next_clip(spec, jnp.float32(2.0), norms, valid, key))
    # the count's noise: this key's standard normal deviate (the one draw next_clip makes)
    deviate = float(jax.random.normal(key, (), jnp.float32))
    # within 2.0: clients 0, 1, 3 (+1/2 each), over: client 2 (-1/2): centred sum 1
    b = (1 + 0.2 * deviate) / 4 + 0.5
    assert got == pytest.approx(2.0 * math.exp(-0.2 * (b - 0.5)), rel=1e-6)
    got = float(privacy.next_clip(spec, jnp.float32(1.0), norms, valid, key))
    b = (0 + 0.2 * deviate) / 4 + 0.5  # within 1.0: clients 0 and 3, over: 1 and 2
    assert got == pytest.approx(math.exp(-0.2 * (b - 0.5)), rel=1e-6)
    # a fixed clip norm stays put
    fixed = DPSpec(clip=1.0, noise_multiplier=0.1, denominator=4.0)
    assert float(privacy.next_clip(fixed, jnp.float32(0.25), norms, valid, key)) == 0.25


def test_next_clip_with_fewer_valid_clients_than_the_denominator_by_hand() -> None:
    """Where k valid clients < the denominator M the centred count differs from the plain count
    of unclipped clients (b = n / M + (M - k) / 2M, not n / M): this tells them apart."""
    spec = DPSpec(clip=1.0, noise_multiplier=0.1, denominator=4.0, target_quantile=0.3)
    norms = np.array([0.5, 1.5, 2.5, 1.0, 0.1], np.float32)
    key = jax.random.key(8)
    deviate = float(jax.random.normal(key, (), jnp.float32))
    cases = [
        # clients 0 and 3 valid, both within 1.0: centred sum 1/2 + 1/2 = 1
        (np.array([True, False, False, True, False]), 1.0),
        # clients 1 and 2 valid, both over 1.0: -1
        (np.array([False, True, True, False, False]), -1.0),
        # client 1 alone, over 1.0: -1/2
        (np.array([False, True, False, False, False]), -0.5),
        # nobody: the count is its noise alone
        (np.zeros(5, bool), 0.0),
    ]
    for valid, centred in cases:
        got = float(privacy.next_clip(spec, jnp.float32(1.0), norms, valid, key))
        b = (centred + 0.2 * deviate) / 4 + 0.5
        assert got == pytest.approx(math.exp(-0.2 * (b - 0.3)), rel=1e-6), valid
    # the uncentred count (2 + noise) / 4 would give another clip norm in the first case
    uncentred = math.exp(-0.2 * ((2 + 0.2 * deviate) / 4 - 0.3))
    got = float(privacy.next_clip(spec, jnp.float32(1.0), norms, cases[0][0], key))
    assert abs(got - uncentred) > 1e-3


def _centred_by_hand(norms: list[float], bound: float, valid: list[bool]) -> float:
    """+1/2 for a valid client within the bound, -1/2 for a valid one over it, 0 if invalid."""
    return sum((0.5 if n <= bound else -0.5) for n, ok in zip(norms, valid, strict=True) if ok)


def _centred(norms: list[float], bound: float, valid: list[bool]) -> float:
    out = privacy.centred_count(np.asarray(norms, np.float32).reshape(-1), jnp.float32(bound),
                                np.asarray(valid, bool).reshape(-1))  # fmt: skip
    assert out.dtype == jnp.float32 and out.shape == ()
    return float(out)


@pytest.mark.parametrize(
    ("norms", "valid"),
    [
        ([], []),  # nobody
        ([0.5], [True]),
        ([0.5, 1.5, 2.5, 1.0], [True] * 4),  # 1.0 exactly at the bound counts as within
        ([3.0, 4.0, 5.0], [True] * 3),  # every client clipped
        ([0.1, 0.2, 0.3], [True] * 3),  # none clipped
        ([0.5, 1.5, 2.5, 1.0, 0.1, 7.0], [True, False, True, True, False, False]),  # invalid ones
        ([0.5, 1.5], [False, False]),  # only invalid clients
    ],
)  # fmt: skip
def test_one_client_moves_the_released_count_by_at_most_one_half(norms, valid) -> None:
    """The add-or-remove sensitivity of the count next_clip releases is 1/2 (what the split of
    the noise between the updates and the count assumes), whoever the client is."""
    bound = 1.0
    base = _centred(norms, bound, valid)
    assert base == _centred_by_hand(norms, bound, valid)
    # remove each client in turn
    for i in range(len(norms)):
        rest_n, rest_v = norms[:i] + norms[i + 1:], valid[:i] + valid[i + 1:]
        moved = abs(_centred(rest_n, bound, rest_v) - base)
        assert moved == (0.5 if valid[i] else 0.0) and moved <= 0.5
    # add a client within the bound, at it, over it (clipped), or invalid
    for norm, ok in ((0.0, True), (1.0, True), (1.0 + 1e-6, True), (100.0, True), (0.5, False),
                     (100.0, False)):  # fmt: skip
        for at in (0, len(norms)):
            more_n, more_v = norms[:at] + [norm] + norms[at:], valid[:at] + [ok] + valid[at:]
            moved = _centred(more_n, bound, more_v) - base
            assert moved == ((0.5 if norm <= bound else -0.5) if ok else 0.0)
            assert abs(moved) <= 0.5


def test_adaptive_clip_moves_towards_the_target_quantile() -> None:
    """Over many keys: a clip norm below every update norm grows (b ~ 0 < gamma), one above every
    norm shrinks (b ~ 1 > gamma), by exp(+-eta gamma) on average."""
    spec = DPSpec(clip=1.0, noise_multiplier=0.5, denominator=100.0, target_quantile=0.4)
    norms = np.linspace(1.0, 2.0, 100).astype(np.float32)
    valid = np.ones(100, bool)
    keys = jax.random.split(jax.random.key(0), 500)
    step = jax.vmap(lambda bound, k: privacy.next_clip(spec, bound, norms, valid, k),
                    in_axes=(None, 0))  # fmt: skip
    up = np.asarray(step(jnp.float32(0.5), keys), np.float64)
    down = np.asarray(step(jnp.float32(3.0), keys), np.float64)
    # b = N(0, 5^2) / 100 below, 1 + N(0, 5^2) / 100 above: log(C'/C) = -0.2 (b - 0.4)
    np.testing.assert_allclose(np.log(up / 0.5).mean(), 0.2 * 0.4, atol=0.002)
    np.testing.assert_allclose(np.log(down / 3.0).mean(), -0.2 * 0.6, atol=0.002)
    np.testing.assert_allclose(np.log(up / 0.5).std(), 0.2 * 5 / 100, rtol=0.1)
    assert up.min() > 0.5 and down.max() < 3.0


def test_init_state_is_the_first_clip_norm() -> None:
    state = privacy.init_state(DPSpec(clip=0.25, noise_multiplier=1.0, denominator=3.0))
    assert set(state) == {"clip"} and state["clip"].dtype == jnp.float32
    assert float(state["clip"]) == 0.25


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"clip": 0.0}, "--dp-clip"),
        ({"clip": -1.0}, "--dp-clip"),
        ({"clip": float("nan")}, "--dp-clip"),
        ({"clip": float("inf")}, "--dp-clip"),
        ({"noise_multiplier": -0.1}, "--dp-noise-multiplier"),
        ({"noise_multiplier": float("nan")}, "--dp-noise-multiplier"),
        ({"denominator": 0.0}, "denominator"),
        ({"target_quantile": 0.0}, "--dp-clip-quantile"),
        ({"target_quantile": 1.0}, "--dp-clip-quantile"),
        ({"target_quantile": 1.5}, "--dp-clip-quantile"),
        # adaptive: z must stay below 2 sigma_b = 2 x 10 / 20 = 1
        ({"target_quantile": 0.5, "noise_multiplier": 1.0}, "--dp-noise-multiplier below 2"),
        ({"target_quantile": 0.5, "noise_multiplier": 0.5, "count_stddev": 0.2},
         "--dp-noise-multiplier below 2"),
    ],
)  # fmt: skip
def test_bad_settings_are_one_line_user_errors(kwargs: dict, flag: str) -> None:
    settings = {"clip": 1.0, "noise_multiplier": 0.5, "denominator": 10.0, **kwargs}
    with pytest.raises(UserError) as info:
        DPSpec(**settings)
    assert flag in str(info.value) and "\n" not in str(info.value)


def test_good_settings_are_accepted() -> None:
    DPSpec(clip=1.0, noise_multiplier=0.0, denominator=1.0)  # clipping without noise
    DPSpec(clip=1e-6, noise_multiplier=100.0, denominator=0.5)
    DPSpec(clip=1.0, noise_multiplier=0.99, denominator=10.0, target_quantile=0.5)


def test_adaptive_clippings_limit_on_z_says_what_it_is_and_what_to_do() -> None:
    # M = 10: sigma_b = 10 / 20 = 0.5, so z must stay below 2 x 0.5 = 1
    with pytest.raises(UserError) as info:
        DPSpec(clip=1.0, noise_multiplier=1.0, denominator=10.0, target_quantile=0.5)
    assert str(info.value) == (
        "adaptive clipping needs --dp-noise-multiplier below 2 x the count's noise (1), got 1: "
        "the centred count's noise is sigma_b = 0.5 (M / 20 with M clients a round); use more "
        "clients a round or a lower multiplier"
    )
    DPSpec(clip=1.0, noise_multiplier=0.999, denominator=10.0, target_quantile=0.5)
