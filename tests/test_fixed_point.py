"""Secure aggregation's fixed point (fed/fixed_point.py): expected values from the definitions, in
exact rational arithmetic (`fractions`), never from the module's own output."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from fedjax_split.errors import UserError
from fedjax_split.fed.fixed_point import (
    FixedPoint,
    dequantise,
    error_bound,
    quantise,
    sum_quantised,
)

LIMIT = 2**63 - 1


def _exact_integer(x: float, w: int, spec: FixedPoint) -> int:
    """round(clip(x, -c, c) w 2^f), ties to even (Python's round of a Fraction)."""
    c = Fraction(spec.clip)
    v = min(max(Fraction(x), -c), c) * w * Fraction(2) ** spec.frac_bits
    return round(v)


def test_the_scale_is_the_largest_that_cannot_wrap() -> None:
    # by hand: N (W c 2^f + 1/2) <= 2^63 - 1; c = W = N = 1 -> f = 62; N = 4 -> 2^f <= 2^61 - 3/4
    assert FixedPoint(1.0, 1, 1).frac_bits == 62
    assert FixedPoint(1.0, 1, 4).frac_bits == 60
    spec = FixedPoint(0.1, 1000, 37)
    c, f = Fraction(spec.clip), spec.frac_bits
    assert 37 * (1000 * c * Fraction(2) ** f + Fraction(1, 2)) <= LIMIT
    assert 37 * (1000 * c * Fraction(2) ** (f + 1) + Fraction(1, 2)) > LIMIT
    assert spec.clip == float(np.float32(0.1))  # the clip is held as its fp32 value


def test_too_many_nodes_times_weight_is_a_one_line_error() -> None:
    # with c = 1 the grid 2^-f <= 2^-24 needs N (W 2^24 + 1/2) <= 2^63 - 1
    most = int(Fraction(LIMIT) / (2**24 + Fraction(1, 2)))
    FixedPoint(1.0, 1, most)
    with pytest.raises(UserError, match="cannot sum") as info:
        FixedPoint(1.0, 1, most + 1)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError):
        FixedPoint(1.0, 2**29, 2)  # x w would no longer be exact in float64
    with pytest.raises(UserError):
        FixedPoint(float("nan"), 1, 2)


def test_quantise_rounds_the_clipped_weighted_value_and_packs_the_extras() -> None:
    spec = FixedPoint(0.5, 100, 8)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, 64).astype(np.float32)  # about half beyond the clip
    x[:3] = [0.5, -0.5, 0.0]
    q = quantise(x, 37, True, spec)
    assert q.dtype == np.uint64 and q.shape == (66,)
    expected = [_exact_integer(float(v), 37, spec) % 2**64 for v in x] + [37, 1]
    assert [int(v) for v in q] == expected
    assert [int(v) for v in quantise(x, 0, False, spec)[-2:]] == [0, 0]


def test_the_sum_of_nodes_dequantises_within_the_stated_error() -> None:
    spec = FixedPoint(1.0, 50, 5)
    rng = np.random.default_rng(1)
    # a quarter of the entries tiny, so that rounding to the grid (2^-55 here) does show
    scale = np.where(np.arange(200) < 50, 1e-16, 1.0)
    xs = [(rng.uniform(-1, 1, 200) * scale).astype(np.float32) for _ in range(5)]
    ws = [3, 50, 1, 17, 8]
    flags = [True, False, True, True, False]
    total = sum_quantised([quantise(x, w, u, spec) for x, w, u in zip(xs, ws, flags, strict=True)])
    got = dequantise(total, spec)
    assert (got.weight, got.unclipped) == (79, 3)
    f = Fraction(2) ** spec.frac_bits
    integers = [
        sum(_exact_integer(float(x[j]), w, spec) for x, w in zip(xs, ws, strict=True))
        for j in range(200)
    ]
    # the integer sum, exactly, then correctly rounded to float64 (exact when |sum| < 2^53)
    assert list(got.weighted_sum) == [float(Fraction(i) / f) for i in integers]
    exact = [
        sum(Fraction(float(x[j])) * w for x, w in zip(xs, ws, strict=True)) for j in range(200)
    ]
    bound = Fraction(5, 2) / f  # half a step a node, derived by hand
    assert error_bound(spec, 5) == bound
    errors = [abs(Fraction(g) - e) for g, e in zip(got.weighted_sum, exact, strict=True)]
    assert all(err <= bound + abs(e) / 2**53 for err, e in zip(errors, exact, strict=True))
    assert max(errors[:50]) > bound / 10  # the tiny entries did round
    # against the fp32 weighted sum, as the plain server adds: that sum's own error is at most
    # gamma_n sum |w x| (n = 5 products and adds, u = 2^-24), plus the quantisation's
    fp32 = np.zeros(200, np.float32)
    for x, w in zip(xs, ws, strict=True):
        fp32 = fp32 + np.float32(w) * x
    u = Fraction(1, 2**24)
    gamma = 5 * u / (1 - 5 * u)
    for j in range(200):
        slack = (
            gamma * sum(abs(Fraction(float(x[j]))) * w for x, w in zip(xs, ws, strict=True)) + bound
        )
        assert abs(Fraction(float(got.weighted_sum[j])) - Fraction(float(fp32[j]))) <= slack


def test_the_extreme_sum_does_not_wrap() -> None:
    spec = FixedPoint(0.25, 9, 6)
    top = np.full(4, 0.25, np.float32)
    for sign in (1, -1):
        total = sum_quantised([quantise(sign * top, 9, True, spec) for _ in range(6)])
        got = dequantise(total, spec)
        assert np.all(got.weighted_sum == sign * 6 * 9 * 0.25)
        assert (got.weight, got.unclipped) == (54, 6)


def test_quantise_refuses_what_it_cannot_represent() -> None:
    spec = FixedPoint(1.0, 10, 3)
    with pytest.raises(ValueError, match="float32"):
        quantise(np.zeros(3, np.float64), 1, True, spec)
    with pytest.raises(ValueError, match="non-finite"):
        quantise(np.array([np.nan], np.float32), 1, True, spec)
    for weight in (11, -1, 1.5):
        with pytest.raises(ValueError, match="weight"):
            quantise(np.zeros(3, np.float32), weight, True, spec)
