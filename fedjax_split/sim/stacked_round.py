"""The stacked execution of a round (`stacked_functions`): the sampled clients' steps stacked
(`batching.stack_clients`, [K, 1, ...] per step) and the round run as three jitted pieces: start
(download, client states), one call per stacked step (all clients at once: vmapped, in chunks of
`chunk_size` clients with `lax.map`, or a loop with `chunk_size=1`; with a mesh the client axis is
sharded over its 'clients' axis by `shard_map`, padded with weight-0 clients to a multiple of the
device count), finish (upload, aggregate, server step). Client states stay on device (and sharded)
between the calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from fedjax_split.data.batch import Batch
from fedjax_split.data.batching import stack_clients
from fedjax_split.errors import UserError
from fedjax_split.fed.aggregation import aggregate
from fedjax_split.fed.client import ClientFns, ClientMetrics, ClientState, make_client_fns
from fedjax_split.fed.client_program import download
from fedjax_split.fed.privacy import clip_upload
from fedjax_split.fed.server import ServerState, upload
from fedjax_split.fed.server_step import server_step
from fedjax_split.fed.wire import wire_dtype
from fedjax_split.sim.round_progress import ProgressHook, Watcher
from fedjax_split.sim.round_spec import RoundSpec, client_keys

CLIENT_AXIS = "clients"


def _pad_clients(tree: Any, pad: int, fill: Any = None) -> Any:
    """Appends `pad` copies of client 0 (or rows of `fill`) along the client axis."""
    if pad == 0:
        return tree

    def one(x: jax.Array) -> jax.Array:
        if fill is None:
            extra = jnp.repeat(x[:1], pad, axis=0)
        else:
            extra = jnp.full((pad,) + x.shape[1:], fill, x.dtype)
        return jnp.concatenate([x, extra], axis=0)

    return jax.tree.map(one, tree)


class StackedFns(NamedTuple):
    """A stacked round's jitted pieces; `segment` compiles once per distinct step shape.

    start(server_state, local_params [K], client_ids, rng) -> (client_states, keys)
    segment(client_states, global_wire, segment [K, S, ...], keys, frozen) -> client_states
    finish(server_state, client_states, num_examples, noise_key, factors) -> (server_state,
      new_local, metrics, (accepted, update norms)); factors: `fed.aggregation.tampered`'s, or None
    Client states and keys are padded with weight-0 clients to a multiple of the device count.
    """

    start: Callable[..., Any]
    segment: Callable[..., Any]
    finish: Callable[..., Any]


def _train_stacked(spec: RoundSpec, fns: ClientFns) -> Callable[..., ClientState]:
    """One stacked step for all clients: vmapped, in chunks (`lax.map`), or a loop over clients
    (chunk_size=1); with a mesh, each device runs its share of the clients (`shard_map`)."""

    def train(client_states: ClientState, received: Any, seg: Any, keys: jax.Array, constants: Any):
        def one(args: tuple[ClientState, Any, jax.Array]) -> ClientState:
            return fns.train_segment(args[0], args[1], received, args[2], constants)

        if spec.chunk_size is None or spec.chunk_size >= keys.shape[0]:
            return jax.vmap(lambda *a: one(a))(client_states, seg, keys)
        if spec.chunk_size == 1:  # a plain loop: no vmap, so padded steps' lax.cond skips them
            # The stacked states are the loop's carry, updated in place one client at a time
            # (lax.map would write a second stacked copy of every state, per segment).
            def body(i: jax.Array, states: ClientState) -> ClientState:
                take = lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False)  # noqa: E731
                new = one((jax.tree.map(take, states), jax.tree.map(take, seg), take(keys)))
                put = lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, i, 0)  # noqa: E731
                return jax.tree.map(put, states, new)

            return jax.lax.fori_loop(0, keys.shape[0], body, client_states)
        return jax.lax.map(one, (client_states, seg, keys), batch_size=spec.chunk_size)

    if spec.mesh is None:
        return train
    clients = PartitionSpec(CLIENT_AXIS)
    return jax.shard_map(
        train,
        mesh=spec.mesh,
        in_specs=(clients, PartitionSpec(), clients, clients, PartitionSpec()),
        out_specs=clients,
        check_vma=False,
    )


def _check_stacked(spec: RoundSpec) -> None:
    """Refuses a mesh without a 'clients' axis and a chunk size below 1."""
    if spec.mesh is not None and CLIENT_AXIS not in spec.mesh.axis_names:
        raise UserError(f"the mesh has axes {spec.mesh.axis_names}; name its axis '{CLIENT_AXIS}'")
    if spec.chunk_size is not None and spec.chunk_size < 1:
        raise UserError(f"chunk size must be >= 1, got {spec.chunk_size}; use a positive integer")


def _shard(spec: RoundSpec, tree: Any) -> Any:
    """`tree`'s client axis sharded over the mesh's 'clients' axis (unchanged without a mesh)."""
    if spec.mesh is None:
        return tree
    sharding = NamedSharding(spec.mesh, PartitionSpec(CLIENT_AXIS))
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


def _pad_segment(seg: Batch, pad: int) -> Batch:
    """A stacked step with `pad` more clients, whose parts are all padding (step mask False)."""
    return _pad_clients(seg.replace(step_mask=None), pad).replace(
        step_mask=_pad_clients(seg.step_mask, pad, False)
    )


@functools.lru_cache(maxsize=32)
def stacked_functions(spec: RoundSpec) -> StackedFns:
    """The jitted pieces of a stacked round for `spec` (cached per spec)."""
    _check_stacked(spec)
    wire = wire_dtype(spec.wire_dtype)
    fns = make_client_fns(spec.client)
    train = _train_stacked(spec, fns)
    num_devices = spec.mesh.devices.size if spec.mesh is not None else 1
    shard = functools.partial(_shard, spec)

    def start(state: ServerState, local_params: Any, client_ids: jax.Array, rng: jax.Array,
              total_steps: jax.Array | None = None):  # fmt: skip
        pad = -client_ids.shape[0] % num_devices
        padded_keys = _pad_clients(client_keys(state.round, rng, client_ids), pad)
        received = download(state.global_params, spec.trained)[0]
        steps = None if total_steps is None else _pad_clients(total_steps, pad, 0)
        init = jax.vmap(fns.init, in_axes=(None, 0, None if steps is None else 0),
                        axis_size=padded_keys.shape[0])  # fmt: skip
        client_states = init(received, _pad_clients(local_params, pad), steps)
        return shard(client_states), shard(padded_keys)

    def segment(
        client_states: ClientState, global_wire: Any, seg: Batch, keys: jax.Array, frozen=None
    ):
        data = _pad_segment(seg, keys.shape[0] - seg.step_mask.shape[0])
        received, constants = download(global_wire, spec.trained, frozen)
        return train(client_states, received, data, keys, constants)

    def finish(state: ServerState, client_states: ClientState, num_examples: jax.Array,
               noise_key: jax.Array, factors: jax.Array | None = None):  # fmt: skip
        num_sampled = num_examples.shape[0]
        pad = client_states.steps.shape[0] - num_sampled
        weights = _pad_clients(jnp.asarray(num_examples, jnp.float32), pad, 0.0)
        new_globals, new_locals, metrics = jax.vmap(fns.finish)(client_states)
        uploads, norms = upload(new_globals, wire), None
        received = download(state.global_params, spec.trained)[0]
        if spec.aggregator.dp is not None:  # each client clips its own update
            clip = jax.vmap(clip_upload, in_axes=(0, None, None, None))
            uploads, norms = clip(uploads, received, state.aggregator["clip"], wire)
        if factors is not None:
            factors = _pad_clients(factors, pad, 1.0)
        agg = aggregate(spec.aggregator, uploads, received, weights, state.aggregator,
                        noise_key, norms, factors)  # fmt: skip
        unpad = lambda x: x[:num_sampled]  # noqa: E731
        return (server_step(spec, state, agg), jax.tree.map(unpad, new_locals),
                jax.tree.map(unpad, metrics), (unpad(agg.valid), unpad(agg.norms)))  # fmt: skip

    return StackedFns(
        jax.jit(start, donate_argnums=(1,) if spec.donate else ()),
        jax.jit(segment, donate_argnums=(0,)),
        # finish's outputs are smaller than the client states: donating those would not help.
        jax.jit(finish, donate_argnums=(0,) if spec.donate else ()),
    )


def run_stacked(
    fns: StackedFns,
    server_state: ServerState,
    local_params: Any,
    ids: jax.Array,
    rng: jax.Array,
    noise_key: jax.Array,
    segments: Sequence[Sequence[Batch]],
    weights: np.ndarray,
    frozen: Any,
    on_progress: ProgressHook | None = None,
    factors: Any = None,
    totals: Sequence[int] | None = None,
) -> tuple[ServerState, Any, ClientMetrics, Any]:
    """Stacked round: the clients' steps stacked step by step, all clients in each call."""
    watcher = None if on_progress is None else Watcher(on_progress, segments, 1)
    steps = None if totals is None else jnp.asarray(totals, jnp.int32)
    client_states, keys = fns.start(server_state, local_params, ids, rng, steps)
    for j, seg in enumerate(stack_clients(segments)):
        seg = seg.for_training()
        client_states = fns.segment(client_states, server_state.global_params, seg, keys, frozen)
        if watcher is not None:
            watcher.enqueued(client_states, [(i, j) for i, c in enumerate(segments) if j < len(c)])
    return fns.finish(server_state, client_states, weights, noise_key, factors)
