"""Client-level differential privacy for the global part (DP-FedAvg, McMahan et al. 2018).

Only the global part leaves a client, so only its updates need noise: each client's update of the
global part (the upload minus the copy it received) is clipped to L2 norm C, the server adds
Gaussian noise of standard deviation z * C to the sum of the clipped updates and divides by a fixed
denominator (the expected number of clients a round). Why uniform weights: with an example-weighted
mean one client's weight, and so its influence on the result, is unbounded, and the noise would no
longer cover it. The local part and the head above the critical layer never leave the client and
get no noise.

Adaptive clipping (Andrew et al. 2021, "Differentially private learning with adaptive clipping"):
C follows a target quantile gamma of the clients' update norms, C <- C * exp(-eta (b - gamma)),
with b the noised fraction of clients whose update norm was at most C. The count is centred, as
in TF-Privacy's QuantileEstimatorQuery: each client taken into the round contributes
1[norm <= C] - 1/2 (`centred_count`), the server adds N(0, sigma_b^2) to that sum, and
b = noised sum / denominator + 1/2 (with k clients of n unclipped, b = n / M + (M - k) / 2M before
noise: in a round short of M clients the absent ones count as half unclipped, as with TF-Privacy's
expected_records). Adding or removing one client moves the sum by exactly 1/2
(the uncentred count of unclipped clients would move by 1), which is what the split of the noise
assumes: a round releases two Gaussians, the updates' sum (sensitivity C, noise z_delta C) and the
centred count (sensitivity 1/2, noise sigma_b), which together are one Gaussian of multiplier z
with z^-2 = z_delta^-2 + (2 sigma_b)^-2. So z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2), defined
only for z < 2 sigma_b, and the accountant is given z (their Theorem 1).

Keys: the server's noise for a round is drawn from the key the caller passes, the round's key from
the server's secret (`fed.secret`: 256 bits of OS entropy, never the run's seed, which config.json
and every node know), so nobody but the server can regenerate the noise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_split.errors import UserError
from fedjax_split.fed.server import upload as wire_upload


@dataclasses.dataclass(frozen=True)
class DPSpec:
    """Client-level DP's settings (static: part of the round's spec)."""

    clip: float  # C, the clip norm (the first round's with adaptive clipping)
    noise_multiplier: float  # z: the noise on the sum is z * C (what the accountant is told)
    denominator: float  # the expected number of clients a round: the sum is divided by it
    target_quantile: float | None = None  # gamma: adaptive clipping; None: C fixed
    clip_learning_rate: float = 0.2  # eta, Andrew et al.'s default
    count_stddev: float | None = None  # sigma_b; None: denominator / 20 (Andrew et al.)

    def __post_init__(self) -> None:
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise UserError(f"--dp-clip must be a positive number, got {self.clip}")
        if not self.noise_multiplier >= 0:
            raise UserError(f"--dp-noise-multiplier must be >= 0, got {self.noise_multiplier}")
        if not self.denominator > 0:
            raise UserError(f"the DP denominator must be > 0, got {self.denominator}")
        if self.target_quantile is not None and not 0 < self.target_quantile < 1:
            raise UserError(
                f"--dp-clip-quantile must be in (0, 1), got {self.target_quantile}; "
                "leave it out for a fixed clip norm"
            )
        if self.adaptive and self.noise_multiplier >= 2 * self.sigma_b:
            source = " (M / 20 with M clients a round)" if self.count_stddev is None else ""
            raise UserError(
                f"adaptive clipping needs --dp-noise-multiplier below 2 x the count's noise "
                f"({2 * self.sigma_b:g}), got {self.noise_multiplier:g}: the centred count's "
                f"noise is sigma_b = {self.sigma_b:g}{source}; use more clients a round or a "
                "lower multiplier"
            )

    @property
    def adaptive(self) -> bool:
        return self.target_quantile is not None

    @property
    def sigma_b(self) -> float:
        """The standard deviation of the noise on the count of unclipped clients."""
        return self.denominator / 20 if self.count_stddev is None else self.count_stddev

    @property
    def update_noise_multiplier(self) -> float:
        """z_delta: the updates' share of the noise (all of it with a fixed clip norm). The
        centred count's sensitivity is 1/2, so its noise sigma_b counts as a Gaussian of
        multiplier 2 sigma_b, and z_delta^-2 + (2 sigma_b)^-2 = z^-2 (module docstring)."""
        z = self.noise_multiplier
        if not self.adaptive or z == 0:
            return z
        return (z**-2 - (2 * self.sigma_b) ** -2) ** -0.5


def init_state(spec: DPSpec) -> dict[str, jax.Array]:
    """The server's DP state: the clip norm of the next round."""
    return {"clip": jnp.asarray(spec.clip, jnp.float32)}


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of a whole tree, in fp32."""
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(squares, jnp.zeros([], jnp.float32)))


def clip_upload(
    upload: Any, received: Any, bound: jax.Array, wire: Any
) -> tuple[Any, jax.Array]:
    """A client's upload with its update clipped to norm `bound`, as the wire carries it; and the
    update's norm before clipping (what adaptive clipping counts).

    `upload` and `received` are fp32 (the upload already the wire's image); the clipped upload is
    received + min(1, bound / norm) * (upload - received), rounded through the wire again. With a
    16-bit wire that rounding can lift the norm a little above the bound, so the server clips again
    (`gaussian_sum`): what it sums is bounded whatever a client sends.
    """
    delta = jax.tree.map(lambda u, r: u - r, upload, received)
    norm = global_norm(delta)
    over = norm > bound
    scale = bound / jnp.maximum(norm, 1e-30)
    # an update within the bound is sent as it is (received + delta would round it again)
    clipped = jax.tree.map(lambda u, r, d: jnp.where(over, r + scale * d, u), upload, received,
                           delta)  # fmt: skip
    return wire_upload(clipped, wire), norm


def noise_like(key: jax.Array, tree: Any, stddev: jax.Array) -> Any:
    """Independent N(0, stddev^2) noise for every element of `tree` (fp32), one key per leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    noise = [
        stddev * jax.random.normal(jax.random.fold_in(key, i), jnp.shape(x), jnp.float32)
        for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, noise)


def noised_mean(spec: DPSpec, clipped_sum: Any, bound: jax.Array, key: jax.Array) -> Any:
    """(sum of the clipped updates + N(0, (z_delta C)^2)) / denominator."""
    noise = noise_like(key, clipped_sum, spec.update_noise_multiplier * bound)
    return jax.tree.map(lambda s, n: (s + n) / spec.denominator, clipped_sum, noise)


def centred_count(norms: jax.Array, bound: jax.Array, valid: jax.Array) -> jax.Array:
    """sum over the valid clients of 1[norm <= bound] - 1/2, fp32: the count adaptive clipping
    releases. Centred so that one client added or removed moves it by exactly 1/2, the
    sensitivity `DPSpec.update_noise_multiplier` assumes; an invalid client adds 0."""
    unclipped = jnp.asarray(norms, jnp.float32) <= jnp.asarray(bound, jnp.float32)
    return jnp.sum(jnp.where(jnp.asarray(valid, bool), jnp.where(unclipped, 0.5, -0.5), 0.0))


def next_clip(
    spec: DPSpec, bound: jax.Array, norms: jax.Array, valid: jax.Array, key: jax.Array
) -> jax.Array:
    """Adaptive clipping's next clip norm from this round's update norms (before clipping), by the
    noised centred count (module docstring); the bound itself when the clip norm is fixed."""
    if not spec.adaptive:
        return bound
    return next_clip_from_count(spec, bound, centred_count(norms, bound, valid), key)


def next_clip_from_count(
    spec: DPSpec, bound: jax.Array, centred: jax.Array, key: jax.Array
) -> jax.Array:
    """`next_clip` from the centred count itself (secure aggregation gives the server the count
    of unclipped clients, never their norms)."""
    if not spec.adaptive:
        return bound
    noised = centred + spec.sigma_b * jax.random.normal(key, (), jnp.float32)
    fraction = noised / spec.denominator + 0.5
    return bound * jnp.exp(-spec.clip_learning_rate * (fraction - spec.target_quantile))
