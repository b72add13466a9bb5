"""Tests for the wire cast (floating leaves only) and byte counting."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fedjax_split.errors import UserError
from fedjax_split.fed.wire import cast_from_wire, cast_to_wire, param_count, tree_bytes, wire_dtype


def _tree() -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 5)).astype(np.float32),
        "b": {"x": rng.standard_normal(7).astype(np.float32)},
        "count": np.array(2**20 + 1, np.int32),  # not representable in fp16/bf16
        "ids": np.arange(4, dtype=np.int64),
    }


@pytest.mark.parametrize(
    "name,np_dtype",
    [("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16), ("float32", np.float32)],
)
def test_cast_touches_floating_leaves_only(name: str, np_dtype: type) -> None:
    tree = _tree()
    sent = cast_to_wire(tree, name)
    assert sent["w"].dtype == np_dtype and sent["b"]["x"].dtype == np_dtype
    np.testing.assert_array_equal(np.asarray(sent["w"]), tree["w"].astype(np_dtype))
    assert sent["count"] is tree["count"] and sent["ids"] is tree["ids"]
    back = cast_from_wire(sent)
    assert back["w"].dtype == np.float32 and back["count"].dtype == np.int32
    np.testing.assert_array_equal(
        np.asarray(back["w"]), tree["w"].astype(np_dtype).astype(np.float32)
    )
    assert int(back["count"]) == 2**20 + 1


def test_cast_is_jittable_and_same_under_jit() -> None:
    tree = {"w": _tree()["w"], "n": np.array(3, np.int32)}
    eager = cast_to_wire(tree, "bfloat16")
    jitted = jax.jit(lambda t: cast_to_wire(t, "bfloat16"))(tree)
    assert jitted["n"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(eager["w"]), np.asarray(jitted["w"]))


def test_tree_bytes_counts_arrays_as_sent() -> None:
    tree = {"w": np.zeros((3, 5), np.float32), "b": {"x": np.zeros(7, np.float32)}}
    n = 3 * 5 + 7
    assert param_count(tree) == n
    assert tree_bytes(tree) == 4 * n
    assert tree_bytes(cast_to_wire(tree, "float16")) == 2 * n
    assert tree_bytes(cast_to_wire(tree, "bfloat16")) == 2 * n
    assert tree_bytes({}) == 0
    assert tree_bytes(jax.eval_shape(lambda t: cast_to_wire(t, "float16"), tree)) == 2 * n


def test_wire_dtype_names() -> None:
    assert wire_dtype("bfloat16") == jnp.bfloat16
    assert wire_dtype(jnp.float16) == jnp.float16
    for bad in ("float64", "int8", "fp17"):
        with pytest.raises(UserError, match="float32, float16, bfloat16"):
            wire_dtype(bad)
