"""Example-weighted mean of the clients' global parts over the client axis.

FedAvg's server step W = sum_i (N_i / N) W_i. Done in fp32 whatever the wire dtype, and by
elementwise multiply-and-add rather than a dot product so that no matmul precision setting (TF32 on
GPUs) can round the weights.

The sum is a loop over clients, acc + w_i * W_i in client order, not a reduction over the client
axis: XLA:CPU lowers that reduction of a broadcast product to a slow strided loop, which on large
tables such as the embeddings costs more than the loop (docs/benchmarks.md measures it). Both
entry points add in the same order, but XLA:CPU may fuse the first multiply-adds of one and not
of the other, so they agree to an ulp or so, not always bit for bit (tests/test_aggregation.py).
What must agree bit for bit, the one-at-a-time simulation and a Flower server, both add the
uploads one at a time with `add_upload` (`fed.server_step.server_round`, one program a client,
so that its compilation does not depend on K); `aggregate_each` adds them with the same pieces.

`aggregate` is the server's whole aggregation step around that mean: it validates every upload
(a non-finite one is left out of the round, as a client of weight 0), and with an `Aggregator`
other than the plain mean it works on the clients' updates (upload minus the copy received):
clipped to a norm bound (`max_update_norm`), combined coordinate-wise by a trimmed mean or a
median (`fed.robust`), or clipped and noised for client-level DP (`fed.privacy`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_split.errors import UserError
from fedjax_split.fed import privacy, robust


def _normalised(weights: jax.Array) -> jax.Array:
    w = jnp.asarray(weights, jnp.float32)
    return w / jnp.sum(w)


def _weighted_sum(stacked_tree: Any, w: jax.Array) -> Any:
    """sum_i w_i x_i over axis 0 in client order, fp32 (a NaN row propagates: `aggregate` zeroes
    the rows it leaves out first)."""

    def total(x: jax.Array) -> jax.Array:
        def add(i: jax.Array, acc: jax.Array) -> jax.Array:
            row = jax.lax.dynamic_index_in_dim(x, i, keepdims=False)
            return acc + w[i] * row.astype(jnp.float32)

        zeros = jnp.zeros(x.shape[1:], jnp.float32)
        if x.shape[0] == 0:  # no client (DP's empty round): the loop's body could not be traced
            return zeros
        return jax.lax.fori_loop(0, x.shape[0], add, zeros)

    return jax.tree.map(total, stacked_tree)


@jax.jit
def weighted_mean(stacked_tree: Any, weights: jax.Array) -> Any:
    """Mean of `stacked_tree` over axis 0 only, weighted by `weights` [K] (example counts N_i).

    Returns fp32 leaves without the client axis. Clients of weight 0 do not count (padding) if
    their rows are finite (`aggregate` zeroes a rejected upload's).
    """
    return _weighted_sum(stacked_tree, _normalised(weights))


RULES = ("mean", "trimmed-mean", "median")


@dataclasses.dataclass(frozen=True)
class Aggregator:
    """How the server combines a round's uploads (static: part of the round's spec).

    rule: "mean" (example-weighted: FedAvg's), "trimmed-mean" or "median" (coordinate-wise over
    the clients, unweighted: `fed.robust`); max_update_norm: each update clipped to this L2 norm
    before the rule (no noise); dp: client-level DP (then the rule is the mean, with uniform
    weights over `dp.denominator`: `fed.privacy`).
    """

    rule: str = "mean"
    trim_fraction: float = 0.1
    max_update_norm: float | None = None
    dp: privacy.DPSpec | None = None
    secure: bool = False  # secure aggregation: the server sees only the sum (`fed.secure_sum`)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise UserError(f"unknown --aggregator {self.rule!r}; use one of: {', '.join(RULES)}")
        robust.check_trim_fraction(self.trim_fraction)
        if self.max_update_norm is not None and not self.max_update_norm > 0:
            raise UserError(f"--max-update-norm must be > 0, got {self.max_update_norm}")
        if self.dp is not None and self.rule != "mean":
            raise UserError(
                f"--aggregator {self.rule} with DP: the noise is calibrated to a sum of clipped "
                "updates; use --aggregator mean with --dp-noise-multiplier"
            )
        if self.secure and self.rule != "mean":
            raise UserError(
                f"--aggregator {self.rule} with --secure-aggregation: a robust rule needs every "
                "upload side by side, and secure aggregation shows the server only their sum; "
                "use --aggregator mean (--max-update-norm still bounds each update: the clients "
                "clip their own)"
            )

    @property
    def plain(self) -> bool:
        """FedAvg's example-weighted mean of the uploads themselves, nothing else."""
        return (self.rule == "mean" and self.max_update_norm is None and self.dp is None
                and not self.secure)  # fmt: skip


def init_state(aggregator: Aggregator) -> Any:
    """The aggregator's state in the server's: DP's clip norm, or nothing."""
    return () if aggregator.dp is None else privacy.init_state(aggregator.dp)


class Aggregated(NamedTuple):
    """What `aggregate` gives the server step and the round's record."""

    mean: Any  # fp32, like an upload: the global part the server steps towards
    state: Any  # the aggregator's state for the next round
    valid: jax.Array  # [K] bool: uploads taken into the round (finite)
    norms: jax.Array  # [K] fp32: each update's L2 norm before any clipping (0 if rejected)


def finite_each(trees: Sequence[Any]) -> jax.Array:
    """[K] bool: whether each client's tree is finite everywhere."""
    return jnp.stack([robust.finite_clients(jax.tree.map(lambda x: x[None], t))[0]
                      for t in trees])  # fmt: skip


def _zeroed(stacked: Any, valid: jax.Array) -> Any:
    """Rows of rejected clients set to zero (a NaN times a zero weight would still be NaN)."""
    return jax.tree.map(
        lambda x: jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0), stacked
    )


def tampered(uploads: Any, received: Any, factors: jax.Array) -> Any:
    """Uploads whose updates are multiplied by `factors` [K] (a study's attackers: -1 flips the
    sign, 100 scales it up); 1 leaves an upload as it was."""
    def one(u: jax.Array, r: jax.Array) -> jax.Array:
        f = factors.reshape((-1,) + (1,) * (u.ndim - 1))
        return jnp.where(f == 1, u, r + f * (u - r))

    return jax.tree.map(one, uploads, received)


def _update_rule(aggregator: Aggregator, deltas: Any, weights: jax.Array, use: jax.Array) -> Any:
    """The non-DP rule over the (clipped) updates: the aggregate update, fp32, no client axis."""
    if aggregator.rule == "mean":
        return weighted_mean(deltas, jnp.where(use, weights, 0.0))
    if aggregator.rule == "trimmed-mean":
        return robust.trimmed_mean(deltas, use, aggregator.trim_fraction)
    return robust.median(deltas, use)


def aggregate(
    aggregator: Aggregator,
    uploads: Any,
    received: Any,
    weights: jax.Array,
    state: Any,
    key: jax.Array,
    reported_norms: jax.Array | None = None,
    factors: jax.Array | None = None,
) -> Aggregated:
    """The server's aggregation of stacked uploads [K, ...] (fp32 wire images of the clients' new
    global parts; `received`: the fp32 copy they started from, no client axis).

    Uploads that are not finite are left out (and reported in `valid`); clients of weight 0
    (padding) never count. If no upload is left, the aggregate is the copy received (no step),
    plus DP's noise when DP is on (the mechanism the accountant is told of runs every round).
    `reported_norms` [K]: the clients' update norms before their own clipping (DP's adaptive
    count); `factors` [K]: `tampered`'s attack, for studies. Pure; jit it with `aggregator` static.
    """
    if factors is not None:
        uploads = tampered(uploads, received, factors)
    weights = jnp.asarray(weights, jnp.float32)
    valid = robust.finite_clients(uploads) if jax.tree.leaves(uploads) else weights == weights
    use = valid & (weights > 0)
    anyone = jnp.any(use)
    if aggregator.plain:
        mean = weighted_mean(_zeroed(uploads, valid), jnp.where(use, weights, 0.0))
        mean = jax.tree.map(lambda m, r: jnp.where(anyone, m, r), mean, received)
        return Aggregated(mean, state, valid, jnp.zeros(weights.shape, jnp.float32))
    deltas = jax.tree.map(lambda u, r: u - r[None].astype(jnp.float32), uploads, received)
    deltas = robust.masked(deltas, use)
    norms = robust.update_norms(deltas)
    reported = norms if reported_norms is None else jnp.asarray(reported_norms, jnp.float32)
    dp = aggregator.dp
    bound = state["clip"] if dp is not None else aggregator.max_update_norm
    if bound is not None:
        deltas = robust.scale_clients(deltas, robust.clip_factors(norms, bound))
    if dp is not None:
        noise_key, count_key = jax.random.split(key)
        update = privacy.noised_mean(dp, _weighted_sum(deltas, use.astype(jnp.float32)), bound,
                                     noise_key)  # fmt: skip
        state = {"clip": privacy.next_clip(dp, bound, reported, use, count_key)}
    else:
        update = _update_rule(aggregator, deltas, weights, use)
        update = jax.tree.map(lambda d: jnp.where(anyone, d, 0.0), update)
    mean = jax.tree.map(lambda r, d: r.astype(jnp.float32) + d, received, update)
    return Aggregated(mean, state, valid, jnp.where(use, reported, 0.0))


def empty_sum(received: Any) -> Any:
    """The plain mean's running sum before any upload: fp32 zeros shaped like `received`."""
    return jax.tree.map(lambda r: jnp.zeros(jnp.shape(r), jnp.float32), received)


def usable_weights(valid: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The plain mean's weights [K]: each usable upload's (finite, `valid`, and of weight > 0)
    share of their total weight, 0 for the others; and whether any upload is usable."""
    weights = jnp.asarray(weights, jnp.float32)
    use = valid & (weights > 0)
    return _normalised(jnp.where(use, weights, 0.0)), jnp.any(use)


def add_upload(acc: Any, upload: Any, ok: jax.Array, w: jax.Array) -> Any:
    """acc + w * upload in fp32, the plain mean's step for one client (nothing of an upload that
    is not finite, `ok` False: a NaN times a zero weight would still be NaN)."""
    return jax.tree.map(lambda a, x: a + w * jnp.where(ok, x, 0.0).astype(jnp.float32), acc,
                        upload)  # fmt: skip


def settled_mean(acc: Any, received: Any, any_use: jax.Array) -> Any:
    """The plain mean's result: the sum, or the global part received when no upload counted."""
    return jax.tree.map(lambda m, r: jnp.where(any_use, m, r), acc, received)


def aggregate_each(
    aggregator: Aggregator,
    uploads: Sequence[Any],
    received: Any,
    weights: jax.Array,
    state: Any,
    key: jax.Array,
    reported_norms: jax.Array | None = None,
    factors: jax.Array | None = None,
) -> Aggregated:
    """`aggregate` of K separate uploads (one tree per client). The plain mean sums them where
    they lie (`add_upload`, no stacked copy); the other rules stack them first."""
    weights = jnp.asarray(weights, jnp.float32)
    if aggregator.plain and factors is None and jax.tree.leaves(uploads):
        valid = finite_each(uploads)
        w, any_use = usable_weights(valid, weights)
        acc = empty_sum(received)
        for i, upload in enumerate(uploads):
            acc = add_upload(acc, upload, valid[i], w[i])
        mean = settled_mean(acc, received, any_use)
        return Aggregated(mean, state, valid, jnp.zeros(weights.shape, jnp.float32))
    if uploads:
        stacked = jax.tree.map(lambda *x: jnp.stack(x), *uploads)
    else:  # nobody sampled: DP's noise still runs
        stacked = jax.tree.map(lambda r: jnp.zeros((0,) + jnp.shape(r), jnp.float32), received)
    return aggregate(aggregator, stacked, received, weights, state, key, reported_norms, factors)
