"""Tests for the per-client DP and robust-aggregation building blocks. Every expected value is
worked out by hand from the tiny arrays written out below."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_split.errors import UserError
from fedjax_split.fed.robust import (
    check_trim_fraction,
    clip_factors,
    fewest_clients_trimmed,
    finite_clients,
    least_trimming_fraction,
    masked,
    median,
    scale_clients,
    trim_count,
    trimmed_mean,
    update_norms,
)

# K = 5 clients; two leaves of different, non-square shapes, so that a reduction over the wrong
# axis gives the wrong shape. Sorted per coordinate, the rows are not in client order.
A = np.array(
    [[1, 10, -3],
     [4, 2, 0],
     [2, 8, 9],
     [7, -1, 5],
     [3, 6, 1]], np.float32)  # fmt: skip
B = np.array(
    [[[0, 5], [1, -2]],
     [[3, 1], [4, 0]],
     [[1, 2], [9, 6]],
     [[2, 4], [-5, 3]],
     [[8, 0], [6, 1]]], np.float32)  # fmt: skip
ALL = np.ones(5, bool)
FIRST_FOUR = np.array([True, True, True, True, False])


def _tree(a: np.ndarray = A, b: np.ndarray = B) -> dict:
    return {"a": a, "n": {"b": b}}


def _check(out: dict, a: list, b: list) -> None:
    assert out["a"].dtype == jnp.float32 and out["n"]["b"].dtype == jnp.float32
    assert out["a"].shape == (3,) and out["n"]["b"].shape == (2, 2)
    np.testing.assert_allclose(np.asarray(out["a"]), a, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["n"]["b"]), b, rtol=1e-6)


def test_median_odd_and_even_number_of_clients() -> None:
    # Columns of A sorted: [1,2,3,4,7], [-1,2,6,8,10], [-3,0,1,5,9].
    _check(median(_tree(), ALL), [3, 6, 1], [[2, 2], [4, 1]])
    # Client 4 left out, k = 4: [1,2,4,7], [-1,2,8,10], [-3,0,5,9]; mean of the middle two.
    # B's coordinates: [0,1,2,3], [1,2,4,5], [-5,1,4,9], [-2,0,3,6].
    _check(median(_tree(), FIRST_FOUR), [3, 5, 2.5], [[1.5, 3], [2.5, 1.5]])


def test_trimmed_mean_odd_and_even_number_of_clients() -> None:
    # k = 5, t = floor(0.2 * 5) = 1: the mean of the middle three of each sorted column.
    _check(trimmed_mean(_tree(), ALL, 0.2), [3, 16 / 3, 2], [[2, 7 / 3], [11 / 3, 4 / 3]])
    # k = 4, t = floor(0.25 * 4) = 1: the middle two, the median.
    _check(trimmed_mean(_tree(), FIRST_FOUR, 0.25), [3, 5, 2.5], [[1.5, 3], [2.5, 1.5]])
    # k = 4, t = floor(0.2 * 4) = 0: the plain mean of the first four clients.
    _check(trimmed_mean(_tree(), FIRST_FOUR, 0.2), [14 / 4, 19 / 4, 11 / 4],
           [[6 / 4, 12 / 4], [9 / 4, 7 / 4]])  # fmt: skip


def test_a_short_round_that_trims_nobody_is_the_plain_unweighted_mean() -> None:
    """A run set to trim (M = 5 at 0.2: one at each end) whose round gets fewer clients (a
    Flower node that failed): with k = 4 valid, floor(0.2 x 4) = 0, so that round is the plain
    unweighted mean of the four, outliers and all; with k = 5 the same call trims."""
    a = A.copy()
    a[0, 0] = 1000.0  # client 0 an outlier in the first coordinate
    _check(trimmed_mean(_tree(a), FIRST_FOUR, 0.2), [1013 / 4, 19 / 4, 11 / 4],
           [[6 / 4, 12 / 4], [9 / 4, 7 / 4]])  # fmt: skip
    # k = 5: t = 1 drops 2 and 1000 of [2, 3, 4, 7, 1000] (client 4's 3 in): the mean of 3, 4, 7
    assert float(trimmed_mean(_tree(a), ALL, 0.2)["a"][0]) == pytest.approx(14 / 3, rel=1e-6)


@pytest.mark.parametrize(
    ("fraction", "k", "want"),
    [
        (0.1, 3, 0), (0.1, 9, 0), (0.1, 10, 1), (0.1, 25, 2), (1 / 3, 3, 1), (0.34, 3, 1),
        (0.33, 3, 0), (0.45, 2, 0), (0.49, 4, 1), (0.4, 5, 2), (0.0, 100, 0), (0.2, 0, 0),
        # floats: (1/49) x 49 = 0.9999999999999999 and 0.29 x 100 = 28.999999999999996
        (1 / 49, 49, 0), (0.29, 100, 28),
    ],
)  # fmt: skip
def test_trim_count_by_hand(fraction: float, k: int, want: int) -> None:
    assert trim_count(fraction, k) == want
    # ... and the trimmed mean drops that many: the values 0..k-1 plus a huge last one
    if k > 0:
        x = np.arange(k, dtype=np.float32)
        x[-1] = 1e6
        got = float(trimmed_mean({"x": x}, np.ones(k, bool), fraction)["x"])
        kept = x[want:k - want].astype(np.float64)
        assert got == pytest.approx(kept.mean(), rel=1e-6)


@pytest.mark.parametrize(
    ("fraction", "want"),
    [(0.1, 10), (1 / 3, 3), (0.34, 3), (0.3, 4), (0.07, 15), (0.25, 4), (0.49, 3), (0.01, 100),
     (1 / 49, 50), (0.0, None)],
)  # fmt: skip
def test_fewest_clients_trimmed_by_hand(fraction: float, want: int | None) -> None:
    assert fewest_clients_trimmed(fraction) == want
    if want is not None:
        assert trim_count(fraction, want) == 1
        assert want == 3 or trim_count(fraction, want - 1) == 0


@pytest.mark.parametrize(
    ("k", "want"),
    [(1, None), (2, None), (3, 0.34), (4, 0.25), (7, 0.15), (9, 0.12), (10, 0.1), (11, 0.091),
     (49, 0.021), (100, 0.01), (101, 0.01), (200, 0.005)],
)  # fmt: skip
def test_least_trimming_fraction_by_hand(k: int, want: float | None) -> None:
    """About 1 / k, rounded up to two significant digits: what the refusal tells a person."""
    assert least_trimming_fraction(k) == want


def test_least_trimming_fraction_trims_and_one_step_less_does_not() -> None:
    for k in range(3, 400):
        f = least_trimming_fraction(k)
        assert f is not None and 1 / k <= f < 0.5 and trim_count(f, k) >= 1, k
        step = 10 ** math.floor(math.log10(f) - 1 + 1e-9)  # the second significant digit
        assert trim_count(f - step, k) == 0, k  # e.g. 0.33 of 3, 0.09 of 10, 0.090 of 11


def test_trim_zero_is_the_plain_mean() -> None:
    _check(trimmed_mean(_tree(), ALL, 0.0), [17 / 5, 25 / 5, 12 / 5],
           [[14 / 5, 12 / 5], [15 / 5, 8 / 5]])  # fmt: skip


def test_trim_never_drops_every_value() -> None:
    # t = floor(0.45 * 5) = 2 keeps only the middle value; one valid client keeps itself.
    _check(trimmed_mean(_tree(), ALL, 0.45), [3, 6, 1], [[2, 2], [4, 1]])
    only_two = np.array([False, False, True, False, False])
    _check(trimmed_mean(_tree(), only_two, 0.45), A[2], B[2])
    _check(median(_tree(), only_two), A[2], B[2])


def test_an_invalid_client_does_not_count_even_when_huge_or_nan() -> None:
    for bad in (1e30, np.nan, np.inf, -np.inf):
        a, b = A.copy(), B.copy()
        a[2], b[2] = bad, bad
        valid = np.array([True, True, False, True, True])
        # Clients 0, 1, 3, 4: A's columns [1,3,4,7], [-1,2,6,10], [-3,0,1,5];
        # B's coordinates [0,2,3,8], [0,1,4,5], [-5,1,4,6], [-2,0,1,3].
        want_a, want_b = [3.5, 4, 0.5], [[2.5, 2.5], [2.5, 0.5]]
        _check(median(_tree(a, b), valid), want_a, want_b)
        _check(trimmed_mean(_tree(a, b), valid, 0.25), want_a, want_b)
        _check(trimmed_mean(_tree(a, b), valid, 0.0), [15 / 4, 17 / 4, 3 / 4],
               [[13 / 4, 10 / 4], [6 / 4, 2 / 4]])  # fmt: skip


def test_no_valid_client_gives_zeros() -> None:
    nan_tree = _tree(np.full_like(A, np.nan), np.full_like(B, np.nan))
    none = np.zeros(5, bool)
    for tree in (_tree(), nan_tree):
        _check(median(tree, none), [0, 0, 0], [[0, 0], [0, 0]])
        _check(trimmed_mean(tree, none, 0.2), [0, 0, 0], [[0, 0], [0, 0]])


def test_one_compiled_function_serves_every_mask() -> None:
    f = jax.jit(lambda tree, valid: (median(tree, valid), trimmed_mean(tree, valid, 0.25)))
    med, trim = f(_tree(), jnp.asarray(ALL))
    _check(med, [3, 6, 1], [[2, 2], [4, 1]])
    _check(trim, [3, 16 / 3, 2], [[2, 7 / 3], [11 / 3, 4 / 3]])  # t = floor(1.25) = 1
    med, trim = f(_tree(), jnp.asarray(FIRST_FOUR))
    _check(med, [3, 5, 2.5], [[1.5, 3], [2.5, 1.5]])
    _check(trim, [3, 5, 2.5], [[1.5, 3], [2.5, 1.5]])
    if hasattr(f, "_cache_size"):
        assert f._cache_size() == 1


def test_finite_clients_finds_nan_and_inf_in_any_leaf() -> None:
    a, b = A.copy(), B.copy()
    b[1, 1, 0] = np.nan
    a[3, 2] = np.inf
    b[4, 0, 1] = -np.inf
    out = finite_clients(_tree(a, b))
    assert out.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(out), [True, False, True, False, False])
    np.testing.assert_array_equal(np.asarray(finite_clients(_tree())), ALL)


def test_update_norms_over_all_leaves() -> None:
    # Client 0: 1 + 100 + 9 from A, 0 + 25 + 1 + 4 from B.
    want = np.sqrt([110 + 30, 20 + 26, 149 + 122, 75 + 54, 46 + 101])
    np.testing.assert_allclose(
        want, np.sqrt((A.astype(np.float64) ** 2).sum(1) + (B.astype(np.float64) ** 2).sum((1, 2)))
    )
    out = update_norms(_tree())
    assert out.dtype == jnp.float32 and out.shape == (5,)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)


def test_clip_factors() -> None:
    norms = np.array([0.0, 3.0, 5.0, 10.0, 20.0], np.float32)
    np.testing.assert_array_equal(np.asarray(clip_factors(norms, 5.0)), [1, 1, 1, 0.5, 0.25])
    np.testing.assert_array_equal(np.asarray(clip_factors(norms, 0.0)), [1, 0, 0, 0, 0])
    # The bound is traced: one compiled function for both.
    f = jax.jit(clip_factors)
    np.testing.assert_array_equal(np.asarray(f(norms, jnp.float32(10.0))), [1, 1, 1, 1, 0.5])
    np.testing.assert_allclose(np.asarray(f(norms, jnp.float32(2.0))), [1, 2 / 3, 0.4, 0.2, 0.1],
                               rtol=1e-6)  # fmt: skip
    assert not np.isnan(np.asarray(f(norms, jnp.float32(0.0)))).any()


def test_clipped_norms_are_at_most_the_bound() -> None:
    norms = np.sqrt([140.0, 46.0, 271.0, 129.0, 147.0])  # 11.8, 6.8, 16.5, 11.4, 12.1
    bound = 12.0
    clipped = scale_clients(_tree(), clip_factors(update_norms(_tree()), bound))
    assert clipped["a"].dtype == jnp.float32 and clipped["n"]["b"].shape == (5, 2, 2)
    np.testing.assert_allclose(np.asarray(update_norms(clipped)), np.minimum(norms, bound),
                               rtol=1e-6)  # fmt: skip
    # Unclipped clients are untouched; client 2 is scaled by 12 / sqrt(271).
    np.testing.assert_array_equal(np.asarray(clipped["a"][1]), A[1])
    np.testing.assert_allclose(np.asarray(clipped["a"][2]), A[2] * 12 / math.sqrt(271), rtol=1e-6)


def test_masked_zeroes_invalid_rows_without_nan() -> None:
    a, b = A.copy(), B.copy()
    a[1], b[3] = np.nan, np.inf
    valid = np.array([True, False, True, False, True])
    out = masked(_tree(a, b), valid)
    assert out["a"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out["a"]), [A[0], [0, 0, 0], A[2], [0, 0, 0], A[4]])
    np.testing.assert_array_equal(np.asarray(out["n"]["b"])[[0, 2, 4]], B[[0, 2, 4]])
    np.testing.assert_array_equal(np.asarray(out["n"]["b"])[[1, 3]], np.zeros((2, 2, 2)))
    half = masked({"h": jnp.asarray([[np.nan], [1.0]], jnp.bfloat16)}, np.array([False, True]))
    assert half["h"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(half["h"], np.float32), [[0.0], [1.0]])


def test_16_bit_leaves_give_fp32_results() -> None:
    # The two inputs are neighbours in their dtype, so their mean is not representable in it:
    # a 16-bit result could not equal it.
    for dtype, low in ((jnp.float16, 2048.0), (jnp.bfloat16, 256.0)):
        tree = {"x": jnp.asarray([[low], [low + 2]], dtype)}
        two = np.array([True, True])
        for out in (median(tree, two), trimmed_mean(tree, two, 0.0)):
            assert out["x"].dtype == jnp.float32
            assert float(out["x"][0]) == low + 1
        norms = update_norms({"x": jnp.asarray([[3.0, 4.0]], dtype)})
        assert norms.dtype == jnp.float32 and float(norms[0]) == 5.0
        assert scale_clients(tree, np.array([1.0, 0.5]))["x"].dtype == jnp.float32


def test_one_outlier_moves_the_mean_but_not_the_median_or_trimmed_mean() -> None:
    # Four honest clients and one sending 100 times the honest (5, 50).
    tree = {"x": np.array([[1, 10], [2, 20], [3, 30], [4, 40], [500, 5000]], np.float32)}
    np.testing.assert_allclose(np.asarray(trimmed_mean(tree, ALL, 0.0)["x"]), [102, 1020])
    np.testing.assert_allclose(np.asarray(median(tree, ALL)["x"]), [3, 30])
    np.testing.assert_allclose(np.asarray(trimmed_mean(tree, ALL, 0.2)["x"]), [3, 30], rtol=1e-6)


@pytest.mark.parametrize("x", [0.0, 0.1, 0.49])
def test_trim_fraction_in_range(x: float) -> None:
    assert check_trim_fraction(x) == x


@pytest.mark.parametrize("x", [-0.1, 0.5, 1.0, float("nan")])
def test_trim_fraction_out_of_range(x: float) -> None:
    with pytest.raises(UserError, match=r"--trim-fraction must be in \[0, 0.5\)"):
        check_trim_fraction(x)
    with pytest.raises(UserError, match="--trim-fraction"):
        trimmed_mean(_tree(), ALL, x)
