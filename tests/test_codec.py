"""deploy.codec: 16-bit wires travel as bits and come back bit for bit, through Flower's own
serialisation (ArrayRecord), with the bytes of the wire-dtype arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fedjax_split.deploy import codec
from fedjax_split.fed.wire import cast_to_wire, tree_bytes


def _tree(rng: np.random.Generator) -> dict:
    # values that 16 bits cannot hold exactly (subnormals, large, tiny), so a rounding would show;
    # all within float16's range (past 65504 it is infinite, which decode refuses)
    x = rng.standard_normal((5, 7)).astype(np.float32) * np.float32(1e3)
    x[0, :3] = [1e-8, -6e-8, 6.1e4]
    return {"enc": {"w": jnp.asarray(x), "b": jnp.asarray(rng.standard_normal(7), jnp.float32)},
            "count": jnp.asarray([3, 4], jnp.int32)}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_through_flower_is_bit_exact(dtype: str) -> None:
    tree = _tree(np.random.default_rng(0))
    sent = codec.encode(tree, dtype)
    back = codec.decode(codec.from_record(codec.to_record(sent)), dtype)
    want = cast_to_wire(tree, dtype)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(back), strict=True):
        assert a.dtype == b.dtype
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()  # bit for bit
    assert codec.nbytes(sent) == tree_bytes(want)
    if dtype != "float32":  # 16-bit floats travel as their bits, never as float16 / V2
        assert sent["enc/w"].dtype == np.uint16
    assert sent["count"].dtype == np.int32  # integer leaves are never cast


def test_plain_numpy_serialisation_would_lose_bfloat16() -> None:
    """Why the bits: np.save (Flower's path) turns bfloat16 into raw V2 bytes; decode refuses."""
    from flwr.app import Array

    x = np.asarray([1.5, -2.0], ml_dtypes.bfloat16)
    mangled = Array(x).numpy()
    assert mangled.dtype.kind == "V"
    with pytest.raises(ValueError, match="not as the bits"):
        codec.decode({"x": mangled}, "bfloat16")
    with pytest.raises(ValueError, match="not as the bits"):
        codec.decode({"x": np.asarray([1.0], np.float16)}, "float16")


def test_check_like_names_the_difference() -> None:
    arrays = {"a": np.zeros((2, 3)), "b": np.zeros(4)}
    codec.check_like(arrays, {"a": (2, 3), "b": (4,)}, "upload")
    with pytest.raises(ValueError, match="unexpected paths \\['b'\\]"):
        codec.check_like(arrays, {"a": (2, 3)}, "upload")
    with pytest.raises(ValueError, match="'a' has shape"):
        codec.check_like(arrays, {"a": (3, 2), "b": (4,)}, "upload")


@pytest.mark.parametrize(("dtype", "sent"), [("float32", np.float32), ("float16", np.uint16),
                                             ("bfloat16", np.uint16)])  # fmt: skip
def test_sent_dtypes_are_what_encode_sends_and_check_like_holds_to_them(
    dtype: str, sent: type
) -> None:
    tree = {"w": jnp.ones((2, 3), jnp.float32), "step": jnp.zeros([], jnp.int32)}
    wire_tree = jax.tree.map(lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x, tree)
    dtypes = codec.sent_dtypes(wire_tree)
    assert dtypes == {"w": np.dtype(sent), "step": np.dtype(np.int32)}
    arrays = codec.encode(tree, dtype)
    assert {p: a.dtype for p, a in arrays.items()} == dtypes
    shapes = {p: a.shape for p, a in arrays.items()}
    codec.check_like(arrays, shapes, "upload", dtypes)
    other = np.float64 if dtype == "float32" else np.float32  # a float where bits are expected
    with pytest.raises(ValueError, match="'w' arrived as"):
        codec.check_like({**arrays, "w": arrays["w"].astype(other)}, shapes, "upload", dtypes)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_value_is_refused_in_every_wire_dtype(dtype: str, bad: float) -> None:
    """One NaN or infinity in a received part (a node's upload, the server's global part) is a
    ValueError, whichever wire it came over; integer leaves are not checked as floats."""
    tree = _tree(np.random.default_rng(1))
    sent = codec.encode(tree, dtype)
    codec.decode(sent, dtype)  # the clean message passes
    poisoned = np.asarray(cast_to_wire(tree, dtype)["enc"]["b"]).copy()
    poisoned[3] = bad
    carrier = poisoned.view(np.uint16) if dtype != "float32" else poisoned
    with pytest.raises(ValueError, match="'enc/b' holds non-finite values"):
        codec.decode({**sent, "enc/b": carrier}, dtype)
