"""What a simulated round is (`RoundSpec`, hashable: each distinct spec compiles once) and what
follows from it alone: which execution strategy runs its clients (`sim.stacked_round` or
`sim.one_at_a_time_round`), on which devices, with which keys, and the bytes each client sends.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from fedjax_split.fed.aggregation import Aggregator
from fedjax_split.fed.client import ClientSpec
from fedjax_split.fed.client_program import client_rngs, round_rng
from fedjax_split.fed.fixed_point import EXTRA_FIELDS
from fedjax_split.fed.roles import select
from fedjax_split.fed.wire import cast_to_wire, param_count, tree_bytes


@dataclasses.dataclass(frozen=True)
class RoundSpec:
    """Static description of a round; hashable, so each distinct spec compiles once.

    `client`, `wire_dtype` and `trained` are all the client program reads (a
    `fed.client_program.ProgramSpec`), `server_optimizer` the server step; the others choose how
    the simulation executes the clients. `donate=True` lets XLA reuse the buffers of the server
    state and local parts passed in, which the caller must then not touch again.
    """

    client: ClientSpec
    server_optimizer: optax.GradientTransformation
    wire_dtype: str = "float32"
    chunk_size: int | None = None
    mesh: Mesh | None = None
    donate: bool = True
    # Clients one at a time (chunk_size=1, no mesh): the devices they are dealt to round-robin,
    # each device running its clients one after another, all devices at once. None: every local
    # device of the default backend (on a CPU, `devices.use_cpu_devices` makes several).
    devices: tuple[Any, ...] | None = None
    # The paths of the global parameters trained this round (a schedule's choice); None: all.
    trained: frozenset[str] | None = None
    # How the server combines the uploads (robust rules, client-level DP); default FedAvg's mean.
    aggregator: Aggregator = Aggregator()


def one_at_a_time(spec: RoundSpec) -> bool:
    """Whether a round runs its clients one at a time from the host, each with its own buffers."""
    return spec.chunk_size == 1 and spec.mesh is None


def round_devices(spec: RoundSpec) -> tuple[Any, ...]:
    """The devices a round's clients train on: the mesh's; one at a time, spec.devices or every
    local device (dealt round-robin); else the first local device (a vmapped round without a mesh
    runs where its inputs are)."""
    if spec.mesh is not None:
        return tuple(spec.mesh.devices.flat)
    if not one_at_a_time(spec):
        return tuple(jax.local_devices()[:1])
    return tuple(jax.local_devices()) if spec.devices is None else tuple(spec.devices)


def client_keys(round_index: jax.Array, rng: jax.Array, client_ids: jax.Array) -> jax.Array:
    """Keys [K] of a round's sampled clients from the run's key (`fed.client_program`'s keys)."""
    return client_rngs(round_rng(rng, round_index), client_ids)


def client_bytes(spec: RoundSpec, global_params: Any) -> tuple[int, int]:
    """(bytes down, bytes up) of one sampled client in a round: the global part in the wire dtype
    down (a client needs the whole current global part), its trained part up. Frozen and local
    parameters are never sent. Works on arrays or shape structs."""
    sent = jax.eval_shape(lambda g: cast_to_wire(g, spec.wire_dtype), global_params)
    up = select(sent, spec.trained)[0]
    if spec.aggregator.secure:  # the masked fixed-point vector: 8 bytes an entry, two more
        return tree_bytes(sent), 8 * (param_count(up) + EXTRA_FIELDS)
    return tree_bytes(sent), tree_bytes(up)
