"""Per-client building blocks for client-level DP and robust aggregation on a stacked tree.

Every function takes a *stacked* pytree (each leaf has a leading client axis K, any float dtype) and
returns fp32, like fed/aggregation.py, by elementwise arithmetic and sorts, never a matmul. Which
clients count is a traced bool mask `valid` [K], so one compiled program serves every mask: the
number of valid clients k is a traced value, and the order statistics index with it dynamically.

Non-finite updates are the caller's to exclude: `finite_clients` finds them, and `masked` zeroes
them with `jnp.where` (NaN * 0 is NaN, so a multiply by the mask would let them through).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_split.errors import UserError


def _per_client(x: jax.Array) -> jax.Array:
    """`x` as [K, elements], whatever its shape after the client axis (K may be 0: a round that
    sampled nobody, where -1 could not be inferred)."""
    return jnp.reshape(x, (x.shape[0], math.prod(x.shape[1:])))


def _rows(v: jax.Array, x: jax.Array) -> jax.Array:
    """The per-client vector `v` [K] shaped to broadcast against the stacked leaf `x`."""
    return jnp.reshape(v, (x.shape[0],) + (1,) * (x.ndim - 1))


def _leaves(stacked: Any) -> list[jax.Array]:
    leaves = jax.tree.leaves(stacked)
    if not leaves:
        raise ValueError("a stacked tree with no leaves has no client axis")
    return leaves


@jax.jit
def finite_clients(stacked: Any) -> jax.Array:
    """bool [K]: True where every element of every leaf of that client is finite."""
    ok = [jnp.all(jnp.isfinite(_per_client(x)), axis=1) for x in _leaves(stacked)]
    return functools.reduce(jnp.logical_and, ok)


@jax.jit
def update_norms(stacked: Any) -> jax.Array:
    """fp32 [K]: each client's L2 norm over all its leaves together (the update's global norm,
    the quantity client-level DP bounds). Squares are summed in fp32 leaf by leaf."""
    squares = [jnp.sum(jnp.square(_per_client(x).astype(jnp.float32)), axis=1)
               for x in _leaves(stacked)]  # fmt: skip
    return jnp.sqrt(functools.reduce(jnp.add, squares))


@jax.jit
def clip_factors(norms: jax.Array, bound: jax.Array) -> jax.Array:
    """fp32 [K]: min(1, bound / norm), the factor that scales an update to norm <= bound; 1 for a
    zero update, which needs no clipping (and must not divide by zero)."""
    norms = jnp.asarray(norms, jnp.float32)
    bound = jnp.asarray(bound, jnp.float32)
    positive = norms > 0
    factor = jnp.minimum(1.0, bound / jnp.where(positive, norms, 1.0))
    return jnp.where(positive, factor, 1.0)


@jax.jit
def scale_clients(stacked: Any, factors: jax.Array) -> Any:
    """fp32 leaves: each client's leaves times its factor from `factors` [K]."""
    f = jnp.asarray(factors, jnp.float32)
    return jax.tree.map(lambda x: x.astype(jnp.float32) * _rows(f, x), stacked)


@jax.jit
def masked(stacked: Any, valid: jax.Array) -> Any:
    """`stacked` with the rows of invalid clients set to zero, by selection so that a NaN or inf
    in an invalid row cannot reach the result. Leaves keep their dtype."""
    v = jnp.asarray(valid, bool)
    return jax.tree.map(lambda x: jnp.where(_rows(v, x), x, jnp.zeros((), x.dtype)), stacked)


def check_trim_fraction(x: float) -> float:
    """`x` if it is a fraction the trimmed mean can trim from each end, else a UserError."""
    if not 0.0 <= x < 0.5:
        raise UserError(
            f"--trim-fraction must be in [0, 0.5), got {x}; it is the fraction of the valid "
            "clients dropped from each end per coordinate (0.1 drops the top and bottom tenth)"
        )
    return x


def trim_count(trim_fraction: float, k: int) -> int:
    """How many of k valid values the trimmed mean drops from each end: floor(trim_fraction * k)
    of the Python float product (what `trimmed_mean` does, so that a check made before a run
    agrees with it), clamped to keep at least one value."""
    return max(0, min(math.floor(trim_fraction * k), (k - 1) // 2))


def fewest_clients_trimmed(trim_fraction: float) -> int | None:
    """The fewest valid clients of which `trim_fraction` drops at least one from each end (None
    for a fraction of 0, which never trims)."""
    if not trim_fraction > 0:
        return None
    k = max(3, math.floor(1 / trim_fraction) - 1)  # just below 1 / f: the float product decides
    while trim_count(trim_fraction, k) == 0:
        k += 1
    return k


def least_trimming_fraction(k: int) -> float | None:
    """The least --trim-fraction, written with two significant digits and rounded up, that drops
    at least one of k valid clients from each end (about 1 / k); None when k < 3, where no
    fraction below 1/2 drops any."""
    if k < 3:
        return None
    digits = 2
    while 10**digits < 10 * k:  # two significant digits of 1 / k
        digits += 1
    n = -(-(10**digits) // k)  # ceil(10^digits / k), exactly
    while trim_count(n / 10**digits, k) == 0:  # the float product may still fall short of 1
        n += 1
    return n / 10**digits


def _trim_counts(trim_fraction: float, num_clients: int) -> jax.Array:
    """int32 [K + 1]: how many values to drop from each end when k clients are valid, indexed by
    k. Tabulated in Python so that floor(trim_fraction * k) is exact rather than an fp32 product,
    and clamped to keep at least one value."""
    counts = [trim_count(trim_fraction, k) for k in range(num_clients + 1)]
    return jnp.asarray(counts, jnp.int32)


def _sorted_valid(x: jax.Array, valid: jax.Array) -> jax.Array:
    """`x` in fp32 sorted along the client axis with the invalid rows set to +inf, so the k valid
    values of each coordinate come first. Valid rows must be finite (see `finite_clients`)."""
    x = x.astype(jnp.float32)
    return jnp.sort(jnp.where(_rows(valid, x), x, jnp.inf), axis=0)


@functools.partial(jax.jit, static_argnames="trim_fraction")
def trimmed_mean(stacked: Any, valid: jax.Array, trim_fraction: float) -> Any:
    """Coordinate-wise trimmed mean over the valid clients (Yin et al. 2018): per coordinate, drop
    the t = floor(trim_fraction * k) largest and t smallest of the k valid values and average the
    rest. Returns fp32 leaves without the client axis; zeros when no client is valid.

    Unweighted: robustness here is counted in clients, a fraction of them may be arbitrary, and
    an order statistic picks a rank among client values. Weighting by example counts would let one
    client that reports a large N_i (a number it chooses) outweigh the honest ones.
    """
    check_trim_fraction(trim_fraction)
    v = jnp.asarray(valid, bool)
    k = jnp.sum(v.astype(jnp.int32))
    t = _trim_counts(trim_fraction, v.shape[0])[k]

    def mean(x: jax.Array) -> jax.Array:
        s = _sorted_valid(x, v)
        rank = _rows(jnp.arange(x.shape[0]), x)
        keep = (rank >= t) & (rank < k - t)
        total = jnp.sum(jnp.where(keep, s, 0.0), axis=0)
        return total / jnp.maximum(k - 2 * t, 1).astype(jnp.float32)

    return jax.tree.map(mean, stacked)


@jax.jit
def median(stacked: Any, valid: jax.Array) -> Any:
    """Coordinate-wise median over the valid clients (the mean of the two middle values when k is
    even), unweighted for the reason `trimmed_mean` gives. fp32 leaves without the client axis;
    zeros when no client is valid."""
    v = jnp.asarray(valid, bool)
    k = jnp.sum(v.astype(jnp.int32))
    lo = jnp.maximum((k - 1) // 2, 0)
    hi = k // 2

    def med(x: jax.Array) -> jax.Array:
        s = _sorted_valid(x, v)
        a = jax.lax.dynamic_index_in_dim(s, lo, axis=0, keepdims=False)
        b = jax.lax.dynamic_index_in_dim(s, hi, axis=0, keepdims=False)
        return jnp.where(k > 0, 0.5 * (a + b), 0.0)

    return jax.tree.map(med, stacked)
