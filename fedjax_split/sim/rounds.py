"""One federated round of many clients in one process (`run_round`): two execution strategies
of the same round (the client sampling before it and the server's step are `fed.strategy`'s and
`fed.server_step`'s).

Steps (FedSplitBERT's Algorithm 1 with a FedOpt server):
1. download: the server holds the global part in the wire dtype; each client casts it to fp32;
2. every sampled client runs its client update (`fed.client_program`: the program one client runs,
   whatever executes it);
3. upload: each client's new global part is cast to the wire dtype;
4. the server aggregates the uploads (`fed.aggregation.aggregate`: by default the
   example-weighted mean in fp32; robust rules and client-level DP as `RoundSpec.aggregator`
   says, DP's clipping done by each client first) and steps the global part
   (`fed.server_step`, the seam every execution strategy and the Flower server share).
Frozen parameters are passed to the clients once, as one unstacked tree (not per client, not
cast). With `RoundSpec.trained` (a schedule's choice for the round) clients train and upload only
those global parameters; the others enter the model as constants, like the frozen ones.
Bytes are counted from the arrays sent (`sim.round_spec.client_bytes`): down, the global part in
the wire dtype; up, its trained part; once per sampled client (zero when the split leaves nothing
global).

Each sampled client brings its own steps (`batching.client_batches`: built from its examples
alone). The two strategies, one module each, both chosen by the round's spec (`sim.round_spec`):
- stacked (`sim.stacked_round`): the clients' steps stacked, all clients in each jitted call
  (vmapped, in chunks, or sharded over a mesh);
- one at a time (`sim.one_at_a_time_round`; `chunk_size=1` and no mesh): each client runs the
  client program with its state in its own buffers, client i on device i % D, all devices at once.
Every step of a run has one shape (`data.batching`), so each program compiles once. Progress, when
asked for, is told as the clients' programs finish (`sim.round_progress`).

Keys: `fed.client_program`'s (round key, then client key from the client's global id, then step
key).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_split.data.batch import Batch
from fedjax_split.errors import UserError
from fedjax_split.fed.client import ClientMetrics, real_steps
from fedjax_split.fed.server import ServerState, init_server_state
from fedjax_split.fed.server_step import checked_noise_key, server_only_step, server_round
from fedjax_split.fed.strategy import sample_clients
from fedjax_split.sim import processes
from fedjax_split.sim.one_at_a_time_round import one_at_a_time_functions, run_one_at_a_time
from fedjax_split.sim.round_progress import ProgressHook
from fedjax_split.sim.round_spec import RoundSpec, client_bytes, one_at_a_time, round_devices
from fedjax_split.sim.stacked_round import run_stacked, stacked_functions

# re-exported: rounds build on the server's state; sampling and the server's step are fed's
__all__ = ["ServerState", "init_server_state", "sample_clients", "server_round",
           "server_only_step", "checked_noise_key"]  # fmt: skip


class RoundResult(NamedTuple):
    """What one round reports besides the new states."""

    train_loss: jax.Array  # [K] mean data loss per sampled client over its real examples
    bytes_down: int  # server -> clients, all sampled clients together
    bytes_up: int  # clients -> server
    metrics: ClientMetrics  # stacked [K]
    accepted: jax.Array  # [K] bool: uploads the server took (a non-finite one is left out)
    update_norms: jax.Array  # [K] each update's L2 norm before clipping (0 unless clipped/robust)


def replicate(tree: Any, num_clients: int) -> Any:
    """Stacks `num_clients` copies of `tree` on a new leading client axis."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients,) + jnp.shape(x)), tree)


def take_clients(stacked: Any, ids: Any) -> Any:
    """Rows `ids` of a client-stacked tree (the sampled clients' local parts)."""
    ids = jnp.asarray(ids)
    return jax.tree.map(lambda x: x[ids], stacked)


def put_clients(stacked: Any, ids: Any, values: Any) -> Any:
    """Writes the sampled clients' new rows back into the full client-stacked tree."""
    ids = jnp.asarray(ids)
    return jax.tree.map(lambda x, v: x.at[ids].set(v), stacked, values)


def run_round(
    spec: RoundSpec,
    server_state: ServerState,
    local_params: Any,
    num_examples: Any,
    segments: Sequence[Sequence[Batch]],
    rng: jax.Array,
    client_ids: Any = None,
    frozen: Any = None,
    on_progress: ProgressHook | None = None,
    update_factors: Any = None,
    local_like: Any = None,
    noise_key: jax.Array | None = None,
) -> tuple[ServerState, Any, RoundResult]:
    """Runs one round for the sampled clients.

    Args:
      local_params: the sampled clients' local parts, stacked on a leading axis K.
      num_examples: [K] training examples per client (the aggregation weights N_i).
      segments: for each sampled client, its steps in order (`batching.client_batches`: batches
        [S, B, ...], padded or packed).
      rng: the run's key (the clients' randomness); the round counter is folded in here.
      client_ids: [K] global ids of the sampled clients (default 0..K-1), for their keys.
      frozen: the frozen parameters, one copy for every client (default none).
      on_progress: called with a `RoundProgress` as the clients' programs finish
        (`sim.round_progress`); None: the host waits for nothing.
      update_factors: [K] factors of `fed.aggregation.tampered` (a study's attackers), or None.
      local_like: a client's local part's shapes (`jax.ShapeDtypeStruct`s), for a process of a
        multi-process simulation that trains none of the round's clients (`sim.processes`);
        with several processes, `local_params` and `segments` hold only this process's
        clients' (others' segments None) and the local parts returned are theirs.
      noise_key: the round's key for the server's DP noise, from the server's secret
        (`fed.secret.ServerSecret.noise_key`), never from `rng`: a DP round without one is
        refused. Unused without DP.
    K = 0 (client-level DP's Poisson sampling drew nobody) runs the server's step alone.
    Returns: new server state, new local parts [K], and the round's RoundResult.
    """
    weights = _checked_weights(num_examples)
    num_sampled = weights.shape[0]
    noise_key = checked_noise_key(spec, noise_key)
    if num_sampled == 0:
        return _run_nobody(spec, server_state, local_params, noise_key)
    if len(segments) != num_sampled:
        raise ValueError(f"{len(segments)} clients' steps for {num_sampled} sampled clients")
    if client_ids is None:
        client_ids = np.arange(num_sampled, dtype=np.int32)
    frozen = {} if frozen is None else frozen
    per_client_down, per_client_up = client_bytes(spec, server_state.global_params)
    state, new_local, metrics, (accepted, norms) = _train_clients(
        spec, server_state, local_params, weights, segments, rng, noise_key, client_ids, frozen,
        on_progress, update_factors, local_like,
    )  # fmt: skip
    train_loss = metrics.loss_sum / jnp.maximum(metrics.num_examples, 1.0)
    result = RoundResult(
        train_loss, per_client_down * num_sampled, per_client_up * num_sampled, metrics,
        accepted, norms,
    )  # fmt: skip
    return state, new_local, result


def _checked_weights(num_examples: Any) -> np.ndarray:
    """The aggregation weights N_i: K non-negative counts with a positive sum (K may be 0)."""
    weights = np.asarray(num_examples)
    if weights.ndim != 1 or not np.all(weights >= 0) or (len(weights) and weights.sum() <= 0):
        raise UserError(
            f"num_examples must be K non-negative counts with a positive sum, got {weights}"
        )
    return weights


def _train_clients(
    spec: RoundSpec,
    server_state: ServerState,
    local_params: Any,
    weights: np.ndarray,
    segments: Sequence[Sequence[Batch]],
    rng: jax.Array,
    noise_key: jax.Array,
    client_ids: Any,
    frozen: Any,
    on_progress: ProgressHook | None,
    update_factors: Any,
    local_like: Any,
) -> tuple[ServerState, Any, ClientMetrics, Any]:
    """The round's training and server step by the strategy `spec` chooses (`run_round`'s
    arguments): (server state, new local parts, metrics, (accepted, update norms))."""
    ids = jnp.asarray(client_ids, jnp.int32)
    factors = None if update_factors is None else jnp.asarray(update_factors, jnp.float32)
    if processes.count() > 1 and local_like is None:  # every process stops, none waits
        raise ValueError("run_round with several processes needs local_like")
    # each client's steps this round, counted on the host, for a linear client schedule (its
    # optimiser ignores them otherwise)
    totals = [None if c is None else int(real_steps(c, np)) for c in segments]
    if one_at_a_time(spec):
        return run_one_at_a_time(
            one_at_a_time_functions(spec), round_devices(spec), server_state, local_params, ids,
            rng, noise_key, segments, weights, frozen, on_progress, factors, local_like, totals,
        )  # fmt: skip
    if processes.count() > 1:
        raise UserError("several processes train one client at a time: use chunk_size=1")
    return run_stacked(
        stacked_functions(spec), server_state, local_params, ids, rng, noise_key, segments,
        weights, frozen, on_progress, factors, totals,
    )  # fmt: skip


def _run_nobody(
    spec: RoundSpec, server_state: ServerState, local_params: Any, noise_key: jax.Array
) -> tuple[ServerState, Any, RoundResult]:
    """A round without clients: the server's step alone, nothing sent, empty [0] figures."""
    empty = jnp.zeros([0], jnp.float32)
    metrics = ClientMetrics(empty, empty, jnp.zeros([0], jnp.int32))
    result = RoundResult(empty, 0, 0, metrics, jnp.zeros([0], bool), empty)
    return server_only_step(spec)(server_state, noise_key), local_params, result
