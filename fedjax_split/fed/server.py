"""The server's side of a round: its state, what it receives, and its optimiser step.

One seam for every execution strategy (the vmapped round, clients one at a time, a Flower
deployment): the clients' uploads are averaged by `aggregation.weighted_mean` (example-weighted,
fp32) and `server_update` turns that mean into the next global part. The server optimiser is any
optax GradientTransformation, applied to the pseudo-gradient -Delta, where Delta = mean - the
copy the clients received (Reddi et al.'s Delta_i = x_i - x(t) with x(t) what client i started
from), and it steps the server's fp32 master copy.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_split.fed.roles import flatten_paths, merge_params, select, unflatten_paths
from fedjax_split.fed.wire import cast_from_wire, cast_to_wire


class ServerState(NamedTuple):
    """The server's state between rounds (a pytree of fixed structure, whatever a schedule trains).

    Covers the global part only: frozen parameters are not the server's to change, and local ones
    never leave their clients.
    """

    global_params: Any  # what is sent: the global part in the wire dtype (paper's Algorithm 1)
    master: Any  # fp32 master copy that the server optimiser steps (see init_server_state)
    opt_state: Any  # server optimiser state over the fp32 global part
    round: jax.Array  # int32, rounds completed
    aggregator: Any = ()  # the aggregation's own state (DP's clip norm: fed.aggregation)


def init_server_state(
    global_params: Any,
    server_optimizer: optax.GradientTransformation,
    wire_dtype: Any,
    aggregator: Any = (),
) -> ServerState:
    """Server state for round 0: an fp32 master copy, its wire-dtype image, a fresh optimiser state.

    Why a master copy: holding only the 16-bit weights (Algorithm 1 read literally) throws away
    every server step smaller than half a 16-bit ulp, each round anew, so with an adaptive server
    (FedAdam's steps are ~lr) weights near 1 never move. The wire still carries 16 bits each way
    and clients still train from the 16-bit weights. Delta is taken against that 16-bit copy, not
    the master, so the master's rounding error is never mistaken for the clients' change.
    The state owns fresh copies (a float32 cast is a no-op that would alias the caller's params,
    which a donating round would then delete).
    """
    master = jax.tree.map(lambda x: jnp.array(x, copy=True), cast_from_wire(global_params))
    held = jax.tree.map(lambda x: jnp.array(x, copy=True), cast_to_wire(master, wire_dtype))
    opt_state = server_optimizer.init(master)
    return ServerState(held, master, opt_state, jnp.zeros([], jnp.int32), aggregator)


def upload(tree: Any, wire_dtype: Any) -> Any:
    """What the server receives of a client's new global part: its wire-dtype image, in fp32."""
    return cast_from_wire(cast_to_wire(tree, wire_dtype))


def _keep_untrained(
    optimizer: optax.GradientTransformation,
    new: Any,
    old: Any,
    trained_mask: Any,
) -> Any:
    """`new` optimiser state with the entries of untrained parameters taken from `old`.

    Without this, a momentum or Adam state would keep moving parameters that a schedule left out
    of the round. Counters and other non-parameter entries take their new values.
    """
    try:
        keep_new = optax.tree_map_params(
            optimizer, lambda _, m: m, new, trained_mask, transform_non_params=lambda _: True
        )
    except Exception as err:  # an optimiser whose state optax cannot map onto the parameters
        raise ValueError(
            "a training schedule needs a server optimizer whose state optax.tree_map_params can "
            f"map onto the parameters ({type(err).__name__}: {err}); use a preset"
        ) from err
    return jax.tree.map(lambda k, n, o: n if k else o, keep_new, new, old)


def server_update(
    state: ServerState,
    mean: Any,
    optimizer: optax.GradientTransformation,
    wire_dtype: Any,
    trained: frozenset[str] | None = None,
) -> ServerState:
    """The server's step from the clients' example-weighted mean upload (fp32).

    Delta = mean - received, with `received` the fp32 image of the wire-dtype copy the clients
    started from; the optimiser steps the fp32 master by the pseudo-gradient -Delta. With a
    16-bit wire this keeps the rounding of the master out of Delta: a round in which no client
    moves leaves the master exactly where it was (with an fp32 wire, received is the master).
    `trained`: the paths of the global parameters the clients trained this round (None: all);
    `mean` then holds only those. Every other global parameter, and its optimiser state, stays
    exactly as it was. Integer leaves are never stepped (they keep the server's value).
    """
    server_copy = state.master
    received = cast_from_wire(state.global_params)
    if trained is not None:
        mean = merge_params(mean, select(received, trained)[1])  # untrained: Delta = 0
    pseudo_grad = jax.tree.map(lambda m, r: r - m, mean, received)  # -Delta
    updates, opt_state = optimizer.update(pseudo_grad, state.opt_state, server_copy)
    stepped = optax.apply_updates(server_copy, updates)
    floating = jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jnp.floating), server_copy)
    if trained is not None:
        flat = flatten_paths(floating)
        floating = unflatten_paths({p: keep and p in trained for p, keep in flat.items()})
        opt_state = _keep_untrained(optimizer, opt_state, state.opt_state, floating)
    master = jax.tree.map(lambda k, new, old: new if k else old, floating, stepped, server_copy)
    return ServerState(cast_to_wire(master, wire_dtype), master, opt_state, state.round + 1,
                       state.aggregator)  # fmt: skip
