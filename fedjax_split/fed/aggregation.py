"""Example-weighted mean of the clients' global parts over the client axis.

FedAvg's server step W = sum_i (N_i / N) W_i. Done in fp32 whatever the wire dtype, and by
elementwise multiply-and-add rather than a dot product so that no matmul precision setting (TF32 on
GPUs) can round the weights.

The sum is a loop over clients, acc + w_i * W_i in client order, not a reduction over the client
axis: XLA:CPU lowers that reduction of a broadcast product to a slow strided loop, which on large
tables such as the embeddings costs more than the loop (docs/benchmarks.md measures it). Both
entry points add in the same order, so they agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


def _normalised(weights: jax.Array) -> jax.Array:
    w = jnp.asarray(weights, jnp.float32)
    return w / jnp.sum(w)


@jax.jit
def weighted_mean(stacked_tree: Any, weights: jax.Array) -> Any:
    """Mean of `stacked_tree` over axis 0 only, weighted by `weights` [K] (example counts N_i).

    Returns fp32 leaves without the client axis. Clients of weight 0 do not count (padding).
    """
    w = _normalised(weights)

    def mean(x: jax.Array) -> jax.Array:
        def add(i: jax.Array, acc: jax.Array) -> jax.Array:
            row = jax.lax.dynamic_index_in_dim(x, i, keepdims=False)
            return acc + w[i] * row.astype(jnp.float32)

        return jax.lax.fori_loop(0, x.shape[0], add, jnp.zeros(x.shape[1:], jnp.float32))

    return jax.tree.map(mean, stacked_tree)


@jax.jit
def weighted_mean_each(trees: Sequence[Any], weights: jax.Array) -> Any:
    """`weighted_mean` of K separate trees (one per client), without stacking them first."""
    w = _normalised(weights)

    def mean(*xs: jax.Array) -> jax.Array:
        acc = jnp.zeros(jnp.shape(xs[0]), jnp.float32)
        for i, x in enumerate(xs):
            acc = acc + w[i] * jnp.asarray(x).astype(jnp.float32)
        return acc

    return jax.tree.map(mean, *trees)
