"""Server optimisers: optax GradientTransformations applied to the pseudo-gradient -Delta.

Each round the server computes Delta = weighted_mean(client globals) - x and feeds g = -Delta to a
GradientTransformation; `optax.apply_updates(x, updates)` gives the new global part. Any optax chain
works (schedules, clipping); the presets below are the FedOpt family:

- `fedavg(1.0)`: SGD on -Delta with lr 1, i.e. x + Delta = the weighted average itself.
- `fedavgm`: SGD with (heavy-ball) momentum, as in Hsu et al. 2019 and FedNLP's default.
- `fedadam`, `fedyogi`, `fedadagrad`: Reddi et al. (ICLR 2021) Algorithm 2 exactly, which differs
  from optax.adam/yogi/adagrad: no bias correction, v starts at tau^2, tau added after the sqrt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_split.errors import UserError


class FedAdaptiveState(NamedTuple):
    """State of Reddi et al.'s adaptive server optimisers."""

    count: jax.Array  # int32 rounds seen, drives a learning-rate schedule
    m: Any  # first moment of Delta, starts at 0
    v: Any  # second-moment estimate, starts at tau^2


def fedavg(learning_rate: optax.ScalarOrSchedule = 1.0) -> optax.GradientTransformation:
    """FedAvg's server: x <- x - lr * g = x + lr * Delta (lr 1: the weighted average)."""
    return optax.sgd(learning_rate)


def fedavgm(
    learning_rate: optax.ScalarOrSchedule = 1.0, momentum: float = 0.9
) -> optax.GradientTransformation:
    """FedAvgM: v <- momentum * v + g, x <- x - lr * v (FedNLP's default server, lr 1, 0.9)."""
    return optax.sgd(learning_rate, momentum=momentum)


def _fed_adaptive(
    learning_rate: optax.ScalarOrSchedule,
    b1: float,
    tau: float,
    second_moment: Callable[[jax.Array, jax.Array], jax.Array],
) -> optax.GradientTransformation:
    """Reddi et al. Algorithm 2 with the given v-update rule v_new = second_moment(v, Delta^2)."""

    def init(params: Any) -> FedAdaptiveState:
        m = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        v = jax.tree.map(lambda p: jnp.full(jnp.shape(p), tau**2, jnp.float32), params)
        return FedAdaptiveState(count=jnp.zeros([], jnp.int32), m=m, v=v)

    def update(
        grads: Any, state: FedAdaptiveState, params: Any = None
    ) -> tuple[Any, FedAdaptiveState]:
        del params
        delta = jax.tree.map(lambda g: -jnp.asarray(g, jnp.float32), grads)
        m = jax.tree.map(lambda m, d: b1 * m + (1.0 - b1) * d, state.m, delta)
        v = jax.tree.map(lambda v, d: second_moment(v, d * d), state.v, delta)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        updates = jax.tree.map(lambda m, v: lr * m / (jnp.sqrt(v) + tau), m, v)
        count = optax.safe_int32_increment(state.count)
        return updates, FedAdaptiveState(count=count, m=m, v=v)

    return optax.GradientTransformation(init, update)


def fedadam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    tau: float = 1e-3,
) -> optax.GradientTransformation:
    """FedAdam: m = b1 m + (1-b1) D; v = b2 v + (1-b2) D^2; x += lr m / (sqrt(v) + tau)."""
    return _fed_adaptive(learning_rate, b1, tau, lambda v, d2: b2 * v + (1.0 - b2) * d2)


def fedyogi(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    tau: float = 1e-3,
) -> optax.GradientTransformation:
    """FedYogi: as FedAdam with v = v - (1-b2) D^2 sign(v - D^2)."""
    return _fed_adaptive(
        learning_rate, b1, tau, lambda v, d2: v - (1.0 - b2) * d2 * jnp.sign(v - d2)
    )


def fedadagrad(
    learning_rate: optax.ScalarOrSchedule, tau: float = 1e-3, b1: float = 0.9
) -> optax.GradientTransformation:
    """FedAdagrad: m = b1 m + (1-b1) D; v = v + D^2; x += lr m / (sqrt(v) + tau).

    Reddi et al.'s Algorithm 2 keeps the momentum m for all three adaptive rules, so b1 = 0.9 is
    the default; b1 = 0 gives momentum-free Adagrad (m = D), as in Flower's FedAdagrad.
    """
    return _fed_adaptive(learning_rate, b1, tau, lambda v, d2: v + d2)


PRESETS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "fedavg": fedavg,
    "fedavgm": fedavgm,
    "fedadam": fedadam,
    "fedyogi": fedyogi,
    "fedadagrad": fedadagrad,
}


def get(name: str, **kwargs: Any) -> optax.GradientTransformation:
    """Builds a preset by name (for configs and the CLI); unknown names are a UserError."""
    factory = PRESETS.get(name)
    if factory is None:
        raise UserError(f"unknown server optimizer {name!r}; use one of {', '.join(PRESETS)}")
    return factory(**kwargs)
