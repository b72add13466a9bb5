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
with b the noised fraction of clients whose update norm was at most C; the count's noise sigma_b
takes part of the privacy budget, so the updates' noise multiplier becomes
z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) and the accountant is given z (their Theorem 1).

Keys: the server's noise for round r comes from fold_in(round key, SERVER_KEY_ID), an id no client
has (clients' keys are fold_in(round key, client id)), so noise and training never share a key and
a resumed run draws the same noise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_split.errors import UserError
from fedjax_split.fed.server import upload as wire_upload

SERVER_KEY_ID = 2**32 - 1  # fold_in data of the server's key: above every client id


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
            raise UserError(
                f"adaptive clipping needs --dp-noise-multiplier below 2 x the count's noise "
                f"({2 * self.sigma_b:g}); raise the clients a round or lower the multiplier"
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
        """z_delta: the updates' share of the noise (all of it with a fixed clip norm)."""
        z = self.noise_multiplier
        if not self.adaptive or z == 0:
            return z
        return (z**-2 - (2 * self.sigma_b) ** -2) ** -0.5


def init_state(spec: DPSpec) -> dict[str, jax.Array]:
    """The server's DP state: the clip norm of the next round."""
    return {"clip": jnp.asarray(spec.clip, jnp.float32)}


def server_key(round_key: jax.Array) -> jax.Array:
    """The server's key for a round's noise (module docstring)."""
    return jax.random.fold_in(round_key, jnp.uint32(SERVER_KEY_ID))


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


def next_clip(
    spec: DPSpec, bound: jax.Array, norms: jax.Array, valid: jax.Array, key: jax.Array
) -> jax.Array:
    """Adaptive clipping's next clip norm from this round's update norms (before clipping); the
    bound itself when the clip norm is fixed."""
    if not spec.adaptive:
        return bound
    unclipped = jnp.sum(jnp.where(valid & (norms <= bound), 1.0, 0.0))
    noised = unclipped + spec.sigma_b * jax.random.normal(key, (), jnp.float32)
    fraction = noised / spec.denominator
    return bound * jnp.exp(-spec.clip_learning_rate * (fraction - spec.target_quantile))
