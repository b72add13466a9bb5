"""The server's step when it may see only the sum of the uploads (secure aggregation).

With secure aggregation (`deploy.secagg`) the server never holds one client's update, only the
sum modulo 2^64 of every client's fixed-point vector (`fed.fixed_point`). Every transport runs
the same three steps, so that the simulation gives the model the deployment gives:
1. `client_vector`, on each client: its update of the trained global part (the upload's fp32 wire
   image minus the fp32 copy it received), clipped by the client itself to the round's L2 bound
   (client-level DP's clip, or --max-update-norm; the server can no longer clip), then quantised
   with its weight (its example count; 1 under DP) and 1[update norm <= bound] for adaptive DP;
2. the sum of the vectors modulo 2^64 (the simulation adds them; SecAgg+ gives the deployment the
   same sum, masks removed);
3. `secure_step`, on the server: the sum dequantised, then FedAvg's example-weighted mean of the
   updates (sum_i w_i x_i / sum_i w_i, in float64, then fp32), or DP's sum of the clipped updates
   plus Gaussian noise from the server's key over the fixed denominator, with adaptive clipping's
   centred count from the unclipped indicator; then the server's step as every round's.

What differs from the server's plain step: the mean is of updates, not of uploads (the same up to
fp32 rounding), and each coordinate of an update is clipped to [-c, c] (c: the round's L2 bound,
else `COORDINATE_CLIP`) and rounded to the fixed-point grid, at most n 2^-(f+1) off the exact sum
(`fixed_point.error_bound`; f >= 24 + log2(1/c): finer than fp32 at the clip).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_split.fed import privacy, robust
from fedjax_split.fed.aggregation import Aggregated, Aggregator
from fedjax_split.fed.client_program import download
from fedjax_split.fed.fixed_point import FixedPoint, dequantise, quantise, sum_quantised
from fedjax_split.fed.server import ServerState
from fedjax_split.fed.wire import param_count

# Each coordinate of an update is clipped to [-1, 1] when the round has no L2 bound: a client's
# update of a pretrained model in one round moves a weight by far less (Adam moves it at most by
# about the learning rate, 5e-5, a step).
COORDINATE_CLIP = 1.0


def round_bound(aggregator: Aggregator, clip: float | None) -> float | None:
    """The round's L2 bound on an update: DP's clip norm this round, --max-update-norm, or None."""
    if aggregator.dp is not None:
        return clip
    return aggregator.max_update_norm


def round_fixed_point(
    aggregator: Aggregator, clip: float | None, max_weight: int, nodes: int
) -> FixedPoint:
    """The round's quantisation, the same for every client and the server: the coordinate clip
    is the round's L2 bound (no coordinate of a clipped update exceeds it) or COORDINATE_CLIP;
    weights up to `max_weight` (1 under DP's uniform weights); `nodes` vectors summed."""
    bound = round_bound(aggregator, clip)
    weight = 1 if aggregator.dp is not None else max(1, int(max_weight))
    return FixedPoint(COORDINATE_CLIP if bound is None else bound, weight, int(nodes))


def client_weight(aggregator: Aggregator, examples: Any) -> int:
    """A client's weight in the sum: its example count (FedAvg), 1 under DP's uniform mean."""
    return 1 if aggregator.dp is not None else int(examples)


@jax.jit
def _clipped_update(upload: Any, received: Any, bound: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the update flat in fp32, clipped to L2 norm `bound`; its norm before clipping)."""
    delta = jnp.concatenate([jnp.ravel(u - r) for u, r in zip(jax.tree.leaves(upload),
                                                              jax.tree.leaves(received),
                                                              strict=True)])  # fmt: skip
    norm = robust.update_norms(delta[None])[0]
    return delta * robust.clip_factors(norm[None], bound)[0], norm


def client_vector(
    upload: Any, received: Any, weight: int, fixed: FixedPoint, bound: float | None,
    reported_norm: float | None = None,
) -> np.ndarray:  # fmt: skip
    """A client's fixed-point vector (uint64): its update (fp32 trees of the trained global part:
    the upload as the wire carries it, the copy received) clipped to `bound` if there is one,
    quantised with `weight`; the unclipped indicator compares `reported_norm` (the update's norm
    before the client's own DP clipping, as adaptive clipping counts it) or else the norm here
    with the bound. Raises ValueError for a non-finite update: such a client sends nothing."""
    if not jax.tree.leaves(upload):
        flat, norm = np.zeros([0], np.float32), 0.0
    else:
        limit = jnp.asarray(np.inf if bound is None else bound, jnp.float32)
        delta, measured = _clipped_update(upload, received, limit)
        flat, norm = np.asarray(delta, np.float32), float(measured)
    norm = norm if reported_norm is None else float(reported_norm)
    unclipped = bound is None or np.float32(norm) <= np.float32(bound)
    return quantise(flat, int(weight), bool(unclipped), fixed)


def simulated_sum(
    aggregator: Aggregator, clip: float | None, uploads: Sequence[Any], received: Any,
    weights: Any, norms: Any = None,
) -> tuple[np.ndarray, FixedPoint, np.ndarray]:  # fmt: skip
    """What SecAgg+ gives the server, computed in one place: (the sum modulo 2^64 of the clients'
    vectors, the round's quantisation, which uploads were summed: the finite ones). The
    deployment's server computes the same from the masked vectors."""
    weights = np.asarray(weights)
    fixed = round_fixed_point(aggregator, clip, int(np.max(weights)), len(uploads))
    bound = round_bound(aggregator, clip)
    vectors, valid = [], []
    for i, upload in enumerate(uploads):
        finite = all(bool(np.all(np.isfinite(x))) for x in jax.tree.leaves(upload))
        valid.append(finite)  # a client whose update is not finite sends nothing
        if finite:
            norm = None if norms is None else float(np.asarray(norms)[i])
            weight = client_weight(aggregator, weights[i])
            vectors.append(client_vector(upload, received, weight, fixed, bound, norm))
    entries = param_count(received)
    total = sum_quantised(vectors) if vectors else np.zeros([fixed.length(entries)], np.uint64)
    return total, fixed, np.asarray(valid, bool)


@functools.partial(jax.jit, static_argnames=("aggregator",))
def _secure_aggregate(
    aggregator: Aggregator, sums: Any, weight: jax.Array, unclipped: jax.Array, received: Any,
    state: Any, key: jax.Array,
) -> tuple[Any, Any]:  # fmt: skip
    """(the global part to step towards, the aggregator's next state) from the sums: with DP the
    noised mean of the clipped updates and the next clip norm; else the mean update (already
    divided by the weight)."""
    dp = aggregator.dp
    update = sums
    if dp is not None:
        bound = state["clip"]
        noise_key, count_key = jax.random.split(key)
        update = privacy.noised_mean(dp, sums, bound, noise_key)
        centred = unclipped.astype(jnp.float32) - 0.5 * weight.astype(jnp.float32)
        state = {"clip": privacy.next_clip_from_count(dp, bound, centred, count_key)}
    return jax.tree.map(lambda r, d: r.astype(jnp.float32) + d, received, update), state


def secure_aggregated(
    aggregator: Aggregator, state: ServerState, trained: frozenset[str] | None,
    total: np.ndarray, fixed: FixedPoint, noise_key: jax.Array,
) -> Aggregated:  # fmt: skip
    """The aggregate from the sum alone (`fed.server_step.secure_round` steps the server with it).
    No client in the sum (weight 0): the copy received, plus DP's noise under DP."""
    received = download(state.global_params, trained)[0]
    summed = dequantise(total, fixed)
    leaves, treedef = jax.tree.flatten(received)
    if aggregator.dp is None:  # FedAvg: sum_i w_i x_i / sum_i w_i in float64, then fp32
        values = summed.weighted_sum / summed.weight if summed.weight > 0 else summed.weighted_sum
    else:  # DP: the sum of the clipped updates (uniform weights), noised over the denominator
        values = summed.weighted_sum
    flat = np.asarray(values, np.float64).astype(np.float32)
    ends = np.cumsum([int(np.size(x)) for x in leaves]).tolist()
    parts = [flat[e - int(np.size(x)) : e].reshape(np.shape(x))
             for e, x in zip(ends, leaves, strict=True)]  # fmt: skip
    sums = jax.tree.unflatten(treedef, parts)
    mean, agg_state = _secure_aggregate(aggregator, sums, jnp.float32(summed.weight),
                                        jnp.float32(summed.unclipped), received, state.aggregator,
                                        noise_key)  # fmt: skip
    return Aggregated(mean, agg_state, jnp.zeros([0], bool), jnp.zeros([0], jnp.float32))
