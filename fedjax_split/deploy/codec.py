"""Parameter trees <-> the arrays a Flower message carries, with 16-bit wires kept exact.

Flower serialises a NumPy array with `np.save`: float16 survives, but bfloat16 (an ml_dtypes
extension type) comes back as raw `V2` bytes, and its built-in strategies would average float16
in float16. So every 16-bit leaf travels as its raw bits (a uint16 view) and the wire dtype is
named in the message's config; the receiver views the bits back (bit-exact, no rounding) and
casts to fp32 itself. fp32 and integer leaves travel as they are.

Keys are the "/"-joined parameter paths (`roles.flatten_paths`), so a receiver can check that a
message holds exactly the parameters it expects, and a test can check that no local path is sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from fedjax_split.fed.roles import flatten_paths, unflatten_paths
from fedjax_split.fed.wire import cast_to_wire, wire_dtype

_BITS = {2: np.uint16}  # itemsize of a 16-bit float -> the unsigned type that carries its bits


def _carrier(dtype: np.dtype) -> type | None:
    """The integer type that carries a 16-bit floating dtype's bits, None for other dtypes."""
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in _BITS:
        return _BITS[dtype.itemsize]
    return None


def encode(tree: Any, dtype: Any) -> dict[str, np.ndarray]:
    """{path: array as sent}: `tree` cast to the wire dtype (floating leaves only), 16-bit
    floating leaves as their uint16 bits. Its bytes are the bytes on the wire."""
    sent = flatten_paths(cast_to_wire(tree, dtype))
    out = {}
    for path, leaf in sent.items():
        arr = np.asarray(leaf)
        bits = _carrier(arr.dtype)
        out[path] = np.ascontiguousarray(arr.view(bits) if bits is not None else arr)
    return out


def decode(arrays: Mapping[str, np.ndarray], dtype: Any) -> dict[str, Any]:
    """Inverse of `encode`: the nested tree in the wire dtype (jax arrays), bit for bit.

    uint16 arrays are read as the 16-bit wire dtype's bits; a uint16 array on a 32-bit wire is
    an integer leaf and stays one. Raises ValueError for a 16-bit float sent as such (it should
    have travelled as bits), a V2 array (bfloat16 mangled by np.save), or a floating leaf with a
    NaN or an infinity: what crosses the wire is parameters, and one non-finite value would
    spread through every model that takes it in."""
    wire = wire_dtype(dtype)
    bits = _carrier(wire)
    flat = {}
    for path, arr in arrays.items():
        arr = np.asarray(arr)
        if arr.dtype.kind == "V" or (_carrier(arr.dtype) is not None):
            raise ValueError(f"{path!r} arrived as {arr.dtype}, not as the bits of {wire.name}")
        if bits is not None and arr.dtype == bits:
            arr = arr.view(wire)
        if np.issubdtype(arr.dtype, np.inexact) or arr.dtype == wire:
            if not np.all(np.isfinite(arr.astype(np.float32))):
                raise ValueError(f"{path!r} holds non-finite values (NaN or infinity)")
        flat[path] = jnp.asarray(arr)
    return unflatten_paths(flat)


def nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Bytes of the arrays as sent (equals `wire.tree_bytes` of the wire-dtype tree)."""
    return int(sum(np.asarray(a).nbytes for a in arrays.values()))


def sent_dtypes(tree: Any) -> dict[str, np.dtype]:
    """{path: the dtype `encode` sends} for a tree already in the wire dtype (16-bit floating
    leaves travel as uint16 bits, every other leaf as it is)."""
    out = {}
    for path, leaf in flatten_paths(tree).items():
        dtype = np.dtype(leaf.dtype)
        bits = _carrier(dtype)
        out[path] = np.dtype(bits) if bits is not None else dtype
    return out


def check_like(
    arrays: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[int, ...]],
    what: str,
    dtypes: Mapping[str, np.dtype] | None = None,
) -> None:
    """ValueError unless `arrays` has exactly the paths and shapes of `expected` ({path: shape})
    and, when `dtypes` is given, exactly those dtypes ({path: dtype as sent})."""
    if set(arrays) != set(expected):
        extra = sorted(set(arrays) - set(expected))[:3]
        missing = sorted(set(expected) - set(arrays))[:3]
        raise ValueError(f"{what}: unexpected paths {extra}, missing paths {missing}")
    for path, arr in arrays.items():
        if tuple(np.shape(arr)) != tuple(expected[path]):
            raise ValueError(
                f"{what}: {path!r} has shape {np.shape(arr)}, expected {tuple(expected[path])}"
            )
        if dtypes is not None and np.asarray(arr).dtype != dtypes[path]:
            raise ValueError(
                f"{what}: {path!r} arrived as {np.asarray(arr).dtype}, expected {dtypes[path]}"
            )


def to_record(arrays: Mapping[str, np.ndarray]) -> Any:
    """A Flower ArrayRecord of `encode`'s arrays (keys = paths)."""
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({path: Array(np.asarray(a)) for path, a in arrays.items()})


def from_record(record: Any) -> dict[str, np.ndarray]:
    """The {path: array} of an ArrayRecord, as np.load gives them back."""
    return {path: array.numpy() for path, array in record.items()}
