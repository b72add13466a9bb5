"""What crosses the wire: the global subtree cast to the wire dtype, and the bytes it takes.

The paper's "+16-bit" variant sends every global weight in 16 bits both ways and trains in fp32.
Only floating leaves are cast: integer leaves (step counters, token ids) keep their dtype, since
casting them would corrupt them silently. Bytes are counted from the arrays as they are sent.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_split.errors import UserError

WIRE_DTYPES = ("float32", "float16", "bfloat16")


def wire_dtype(dtype: Any) -> jnp.dtype:
    """Resolves a wire dtype given by name ("float16") or as a dtype; others are a UserError."""
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in WIRE_DTYPES:
        raise UserError(f"unknown wire dtype {dtype!r}; use one of {', '.join(WIRE_DTYPES)}")
    return resolved


def _is_floating(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def cast_to_wire(tree: Any, dtype: Any) -> Any:
    """Casts the floating leaves of `tree` to the wire dtype; other leaves stay untouched."""
    dtype = wire_dtype(dtype)
    return jax.tree.map(lambda x: jnp.asarray(x, dtype) if _is_floating(x) else x, tree)


def cast_from_wire(tree: Any, dtype: Any = jnp.float32) -> Any:
    """Casts received floating leaves back to the training dtype (fp32); other leaves untouched."""
    dtype = jnp.dtype(dtype)
    return jax.tree.map(lambda x: jnp.asarray(x, dtype) if _is_floating(x) else x, tree)


def tree_bytes(tree: Any) -> int:
    """Bytes of the arrays in `tree` (size x itemsize); arrays, tracers or shape structs."""
    return int(
        sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
    )


def param_count(tree: Any) -> int:
    """Number of scalar parameters in `tree`."""
    return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree)))
