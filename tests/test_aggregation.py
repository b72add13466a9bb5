"""Tests for the example-weighted mean over the client axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_split.fed.aggregation import weighted_mean, weighted_mean_each


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


def test_weighted_mean_each_equals_stacked_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    tree = {"a": rng.standard_normal((4, 3, 5)).astype(np.float32),
            "b": {"c": rng.standard_normal((4, 7)).astype(np.float16)}}  # fmt: skip
    n = np.array([3.0, 0.0, 11.0, 5.0])
    stacked = weighted_mean(tree, n)
    each = weighted_mean_each(
        [{"a": tree["a"][i], "b": {"c": tree["b"]["c"][i]}} for i in range(4)], n
    )
    for x, y in zip(jax.tree.leaves(stacked), jax.tree.leaves(each), strict=True):
        assert y.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    want = (3 * tree["a"][0].astype(np.float64) + 11 * tree["a"][2] + 5 * tree["a"][3]) / 19
    np.testing.assert_allclose(np.asarray(each["a"]), want, rtol=1e-6, atol=1e-7)
