"""Example-weighted mean of the clients' global parts over the leading client axis.

FedAvg's server step W = sum_i (N_i / N) W_i. Done in fp32 whatever the wire dtype, and by
elementwise multiply-and-sum rather than a dot product so that no matmul precision setting (TF32 on
GPUs) can round the weights.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


@jax.jit
def weighted_mean(stacked_tree: Any, weights: jax.Array) -> Any:
    """Mean of `stacked_tree` over axis 0 only, weighted by `weights` [K] (example counts N_i).

    Returns fp32 leaves without the client axis. Clients of weight 0 do not count (padding).
    """
    w = jnp.asarray(weights, jnp.float32)
    w = w / jnp.sum(w)

    def mean(x: jax.Array) -> jax.Array:
        x = jnp.asarray(x, jnp.float32)
        return jnp.sum(w.reshape((-1,) + (1,) * (x.ndim - 1)) * x, axis=0)

    return jax.tree.map(mean, stacked_tree)
