"""The server's step of a round: aggregate the clients' uploads and step the global part.

Pure functions of the server state, the uploads and the round's spec, shared by every
transport: the simulation's one-at-a-time round (`sim.rounds`) and the Flower server
(`deploy.rounds`) call the same programs, so that both compute the same aggregate bit for bit
(the stacked simulation round fuses the same `fed.aggregation.aggregate` into its own program).
`fed.strategy.Strategy.aggregate` is the entry point a transport calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_split.fed.aggregation import (
    Aggregated,
    Aggregator,
    add_upload,
    aggregate_each,
    empty_sum,
    finite_each,
    settled_mean,
    usable_weights,
)
from fedjax_split.fed.client_program import download
from fedjax_split.fed.fixed_point import FixedPoint
from fedjax_split.fed.secret import no_noise_key
from fedjax_split.fed.secure_sum import secure_aggregated, simulated_sum
from fedjax_split.fed.server import ServerState, server_update
from fedjax_split.fed.wire import wire_dtype


class ServerSpec(Protocol):
    """What the server's step reads of a round's spec (`sim.round_spec.RoundSpec` has it all);
    hashable, so each distinct spec compiles once."""

    server_optimizer: optax.GradientTransformation
    wire_dtype: str
    trained: frozenset[str] | None
    aggregator: Aggregator
    donate: bool


def server_step(spec: ServerSpec, state: ServerState, agg: Aggregated) -> ServerState:
    """The server's step on the clients' aggregate: every strategy's, and the Flower server's."""
    return server_update(state._replace(aggregator=agg.state), agg.mean, spec.server_optimizer,
                         wire_dtype(spec.wire_dtype), spec.trained)  # fmt: skip


def aggregate_uploads(
    spec: ServerSpec,
    state: ServerState,
    uploads: list[Any],
    num_examples: jax.Array,
    noise_key: jax.Array,
    norms: jax.Array | None = None,
    factors: jax.Array | None = None,
) -> Aggregated:
    """The server's aggregation of K separate uploads (fp32 wire images, in client order), with
    the round's secret noise key (`fed.secret.ServerSecret.noise_key`): the one-at-a-time round's
    and the Flower server's (`deploy.rounds`), so that both compute the same aggregate. `norms`:
    the clients' update norms before DP's clipping, as they report them."""
    received = download(state.global_params, spec.trained)[0]
    return aggregate_each(spec.aggregator, uploads, received, num_examples, state.aggregator,
                          noise_key, norms, factors)  # fmt: skip


@functools.lru_cache(maxsize=32)
def server_only_step(spec: ServerSpec) -> Callable[..., Any]:
    """(server state, noise key) -> server state: a round that sampled no client (client-level
    DP's Poisson sampling may draw none), the server's step on nothing (DP's noise still runs).
    The simulation's and the Flower server's."""

    def nobody(state: ServerState, noise_key: jax.Array) -> ServerState:
        return server_step(
            spec, state, aggregate_uploads(spec, state, [], jnp.zeros([0]), noise_key)
        )

    return jax.jit(nobody)


class StreamedFns(NamedTuple):
    """The plain mean's server step as programs whose shapes do not depend on K (see
    `server_round`): check(upload) -> finite everywhere; weigh(valid [K], weights [K]) -> (the
    normalised weights of the usable uploads, whether any is); add(acc, upload, ok, w) -> acc +
    w * upload (zero if not ok); start(state) -> zeros like the trained global part;
    finish(state, acc, any usable) -> the new server state."""

    check: Callable[..., Any]
    weigh: Callable[..., Any]
    add: Callable[..., Any]
    start: Callable[..., Any]
    finish: Callable[..., Any]


@functools.lru_cache(maxsize=32)
def streamed_functions(spec: ServerSpec) -> StreamedFns:
    """The jitted pieces of the plain mean's server step for `spec` (cached per spec):
    `fed.aggregation`'s own, which `aggregate_each` runs in one program."""

    def check(upload: Any) -> jax.Array:
        return finite_each([upload])[0]

    def start(state: ServerState) -> Any:
        return empty_sum(download(state.global_params, spec.trained)[0])

    def finish(state: ServerState, acc: Any, any_use: jax.Array) -> ServerState:
        mean = settled_mean(acc, download(state.global_params, spec.trained)[0], any_use)
        return server_step(spec, state, Aggregated(mean, state.aggregator, jnp.zeros([0], bool),
                                                   jnp.zeros([0], jnp.float32)))  # fmt: skip

    return StreamedFns(jax.jit(check), jax.jit(usable_weights),
                       jax.jit(add_upload, donate_argnums=(0,)), jax.jit(start),
                       jax.jit(finish, donate_argnums=(0,) if spec.donate else ()))  # fmt: skip


def streams(spec: ServerSpec, uploads: Sequence[Any], factors: Any = None) -> bool:
    """Whether the server's step over separate uploads streams them (`server_round`): the plain
    mean of uploads that hold something (c = 0 trains no global part)."""
    return spec.aggregator.plain and factors is None and bool(jax.tree.leaves(uploads))


def server_round(
    spec: ServerSpec,
    state: ServerState,
    uploads: Sequence[Any],
    weights: Any,
    noise_key: jax.Array,
    norms: jax.Array | None = None,
    factors: jax.Array | None = None,
) -> tuple[ServerState, tuple[jax.Array, jax.Array]]:
    """The server's aggregation and step over K separate uploads (fp32 wire images, in client
    order): the one-at-a-time round's and the Flower server's. Returns (new state, (accepted
    [K], update norms [K])).

    FedAvg's plain mean streams the uploads: a program checks each, one adds each to a running
    sum, one steps the server, each compiled once whatever K is. One program over all K uploads
    (the rules that need them side by side: robust ones, DP) took seconds to compile, more with
    K (1.9 s at K = 3, 6 s at K = 30 for MiniLM's lower half on this CPU), and again for every
    new K (Poisson sampling draws one each round). The pieces are `fed.aggregation`'s, which
    `aggregate_each` runs in one program."""
    if not uploads:
        raise ValueError("server_round needs at least one upload (server_only_step: none)")
    if spec.aggregator.secure:  # what SecAgg+ would give the server: the sum alone
        clip = None if spec.aggregator.dp is None else float(state.aggregator["clip"])
        received = download(state.global_params, spec.trained)[0]
        total, fixed, valid = simulated_sum(spec.aggregator, clip, uploads, received,
                                            np.asarray(weights), norms)  # fmt: skip
        new_state = secure_round(spec, state, total, fixed, noise_key)
        return new_state, (jnp.asarray(valid), jnp.zeros(np.shape(weights), jnp.float32))
    weights = jnp.asarray(weights, jnp.float32)
    if not streams(spec, uploads, factors):
        return _stacked_server_round(spec)(state, tuple(uploads), weights, noise_key, norms,
                                           factors)  # fmt: skip
    fns = streamed_functions(spec)
    valid = jnp.stack([fns.check(u) for u in uploads])
    w, any_use = fns.weigh(valid, weights)
    acc = fns.start(state)
    for i, u in enumerate(uploads):
        acc = fns.add(acc, u, valid[i], w[i])
    return fns.finish(state, acc, any_use), (valid, jnp.zeros(weights.shape, jnp.float32))


def secure_round(
    spec: ServerSpec, state: ServerState, total: np.ndarray, fixed: FixedPoint,
    noise_key: jax.Array,
) -> ServerState:  # fmt: skip
    """The server's step from the sum of the clients' fixed-point vectors alone (secure
    aggregation, `fed.secure_sum`): the simulation's (`server_round`) and the deployment's, whose
    sum comes from SecAgg+'s masked vectors."""
    agg = secure_aggregated(spec.aggregator, state, spec.trained, total, fixed, noise_key)
    return _secure_step(spec)(state, agg)


@functools.lru_cache(maxsize=32)
def _secure_step(spec: ServerSpec) -> Callable[..., Any]:
    return jax.jit(functools.partial(server_step, spec))


@functools.lru_cache(maxsize=32)
def _stacked_server_round(spec: ServerSpec) -> Callable[..., Any]:
    """The server's step over K uploads in one program (robust rules, DP, a study's factors)."""

    def step(state: ServerState, uploads: tuple, weights: jax.Array, noise_key: jax.Array,
             norms: jax.Array | None, factors: jax.Array | None):  # fmt: skip
        agg = aggregate_uploads(spec, state, list(uploads), weights, noise_key, norms, factors)
        return server_step(spec, state, agg), (agg.valid, agg.norms)

    return jax.jit(step, donate_argnums=(0,) if spec.donate else ())


def checked_noise_key(spec: ServerSpec, noise_key: jax.Array | None) -> jax.Array:
    """The round's noise key; without DP a fixed key nothing draws from. DP without a key is a
    programming error: a key made up here would be public."""
    if noise_key is not None:
        return noise_key
    if spec.aggregator.dp is not None:
        raise ValueError("a DP round needs the server's secret noise key (fed.secret)")
    return no_noise_key()
