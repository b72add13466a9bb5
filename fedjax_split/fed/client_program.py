"""The program one client runs in a round, whatever executes it.

The simulation running its clients one at a time (`sim.rounds`), a node of a real federation
(`deploy.node`) and a further pre-training client (`sim.pretrain_rounds`) all run these jitted
functions, so a client computes the same model bit for bit wherever it runs:
1. download: the global part received in the wire dtype, cast to fp32 and split into the part
   trained this round (`trained`; a schedule's choice, None: all) and the rest, which enters the
   model as constants together with the frozen parameters;
2. `start_one`, then `segment_one` for each of the client's steps (`batching.client_batches`,
   built from its own examples), its state held in its own buffers between the calls;
3. `finish_one`: the upload, the new global part cast to the wire dtype and back to fp32 (what the
   server receives), the new local part (kept) and the metrics.

Keys: round key = fold_in(run key, round), client key = fold_in(round key, client id), step key =
fold_in(client key, real step index) (`fed.client.step_rng`). A client's key depends on its global
id, never on its position among the sampled clients, so it is the same wherever it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_split.data.batch import Batch
from fedjax_split.fed.client import (
    ClientMetrics,
    ClientSpec,
    ClientState,
    make_client_fns,
    real_steps,
)
from fedjax_split.fed.privacy import clip_upload
from fedjax_split.fed.roles import merge_params, select
from fedjax_split.fed.server import upload
from fedjax_split.fed.wire import cast_from_wire, wire_dtype


class ProgramSpec(Protocol):
    """What the client program reads of a round's description (`sim.round_spec.RoundSpec` is one):
    the client update, the wire dtype and the global paths trained this round (None: all)."""

    @property
    def client(self) -> ClientSpec: ...

    @property
    def wire_dtype(self) -> str: ...

    @property
    def trained(self) -> frozenset[str] | None: ...


def round_rng(run_rng: jax.Array, round_index: jax.Array | int) -> jax.Array:
    """Key of one round."""
    return jax.random.fold_in(run_rng, round_index)


def client_rngs(round_key: jax.Array, client_ids: jax.Array) -> jax.Array:
    """Keys [K] of the sampled clients, from their global ids (not their position in the sample)."""
    return jax.vmap(lambda i: jax.random.fold_in(round_key, i))(jnp.asarray(client_ids))


def client_key(run_rng: jax.Array, round_index: int, client_id: int) -> jax.Array:
    """A client's key for a round: fold_in(fold_in(run key, rounds completed), client id)."""
    return jax.random.fold_in(round_rng(run_rng, round_index), client_id)


def download(
    global_wire: Any, trained: frozenset[str] | None, frozen: Any = None
) -> tuple[Any, Any]:
    """(trained global part, constants) as a client holds them: received in the wire dtype, cast
    to fp32; the constants are the frozen parameters and the untrained global ones (only the
    untrained ones when `frozen` is None)."""
    part, untrained = select(cast_from_wire(global_wire), trained)
    return part, untrained if frozen is None else merge_params(frozen, untrained)


class ClientProgram(NamedTuple):
    """One client's round in three jitted pieces; `segment_one` compiles once per step shape.

    start_one(global_wire, local, key, total_steps=None) -> client_state (total_steps: the
      client's steps this round, `fed.client.real_steps`, which a linear client schedule needs)
    segment_one(client_state, global_wire, segment [S, ...], key, frozen) -> client_state
    finish_one(client_state) -> (upload in fp32, new local part, metrics)
    clip_one(upload, global_wire, bound) -> (upload with its update clipped to norm `bound`, the
      update's norm before clipping): client-level DP's clipping (`fed.privacy.clip_upload`)
    The client state passed to `segment_one` and `finish_one` is donated (not to be reused).
    """

    start_one: Callable[..., ClientState]
    segment_one: Callable[..., ClientState]
    finish_one: Callable[..., tuple[Any, Any, ClientMetrics]]
    clip_one: Callable[..., tuple[Any, jax.Array]]


def client_functions(spec: ProgramSpec) -> ClientProgram:
    """The client program of `spec`, shared by every spec with the same client update, wire dtype
    and trained paths (whatever executes the round), so each compiles once."""
    return _client_functions(spec.client, spec.wire_dtype, spec.trained)


@functools.lru_cache(maxsize=32)
def _client_functions(
    client: ClientSpec, wire_name: str, trained: frozenset[str] | None
) -> ClientProgram:
    wire = wire_dtype(wire_name)
    fns = make_client_fns(client)

    def start_one(
        global_wire: Any, local: Any, key: jax.Array, total_steps: jax.Array | None = None
    ) -> ClientState:
        del key  # the key enters at every step; kept in the signature for symmetry with segments
        return fns.init(download(global_wire, trained)[0], local, total_steps)

    def segment_one(
        client_state: ClientState, global_wire: Any, seg: Any, key: jax.Array, frozen: Any = None
    ) -> ClientState:
        received, constants = download(global_wire, trained, frozen)
        return fns.train_segment(client_state, seg, received, key, constants)

    def finish_one(client_state: ClientState) -> tuple[Any, Any, ClientMetrics]:
        new_global, new_local, metrics = fns.finish(client_state)
        return upload(new_global, wire), new_local, metrics

    def clip_one(upload: Any, global_wire: Any, bound: jax.Array) -> tuple[Any, jax.Array]:
        return clip_upload(upload, download(global_wire, trained)[0], bound, wire)

    return ClientProgram(
        jax.jit(start_one),  # a client's local part is the caller's (a row of [K], a node's own)
        jax.jit(segment_one, donate_argnums=(0,)),
        jax.jit(finish_one, donate_argnums=(0,)),
        jax.jit(clip_one),
    )


def client_round(
    spec: ProgramSpec,
    global_wire: Any,
    local: Any,
    segments: Sequence[Batch],
    key: jax.Array,
    frozen: Any = None,
) -> tuple[Any, Any, ClientMetrics]:
    """One client's part of a round: train from the received global part (in the wire dtype) and
    its own local part on its own steps (`batching.client_batches`); returns (its upload as the
    server receives it, in fp32; its new local part; its metrics).

    `key`: `client_key(run key, round, client id)`; `frozen`: the frozen parameters (default none).
    Client-level DP clips the upload afterwards (`ClientProgram.clip_one`).
    """
    program = client_functions(spec)
    frozen = {} if frozen is None else frozen
    total = jnp.int32(real_steps(segments, np))  # for a linear client schedule; else ignored
    state = program.start_one(global_wire, local, key, total)
    for seg in segments:
        state = program.segment_one(state, global_wire, seg.for_training(), key, frozen)
    return program.finish_one(state)
