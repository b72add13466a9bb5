"""One federated round of many clients in one process: two execution strategies of the same
round (the client sampling before it and the server's step are `fed.strategy`'s and
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
Bytes are counted from the arrays sent: down, the global part in the wire dtype; up, its trained
part; once per sampled client (zero when the split leaves nothing global).

Each sampled client brings its own steps (`batching.client_batches`: built from its examples
alone). The two strategies, one factory each:
- stacked (`stacked_functions`): the clients' steps are stacked (`batching.stack_clients`,
  [K, 1, ...] per step) and the round runs as three jitted pieces: start (download, client
  states), one call per stacked step (all clients at once: vmapped, in chunks of `chunk_size`
  clients with `lax.map`, or a loop with `chunk_size=1`; with a mesh the client axis is sharded
  over its 'clients' axis by `shard_map`, padded with weight-0 clients to a multiple of the device
  count), finish (upload, aggregate, server step). Client states stay on device (and sharded)
  between the calls.
- one at a time (`one_at_a_time_functions`; `chunk_size=1` and no mesh): each client runs the
  client program (`fed.client_program.client_round`'s pieces) with its state in its own buffers
  for the whole round, and `combine` aggregates the uploads: the host only enqueues the client's
  step programs (no device-to-host transfer inside the round), and a client of a real federation
  (`fedjax_split.deploy`) computes the same model bit for bit. With several devices
  (`RoundSpec.devices`, by default every local one: on a CPU see `devices.use_cpu_devices`),
  client i runs on device i % D, all devices at once.
Every step of a run has one shape (`data.batching`), so each program compiles once.

Progress (`run_round(on_progress=...)`, off by default): the host learns when a client program
has finished only by waiting for it, so with a hook the loop waits, after enqueueing each program,
for the one enqueued a device's worth earlier (a scalar read from its output before the next
program takes that output over): every device keeps one program queued behind the one running, and
the hook hears the clients, steps and examples finished so far. Without a hook the host waits for
nothing and the round is unchanged; with one the models are the same bit for bit.

Keys: `fed.client_program`'s (round key, then client key from the client's global id, then step
key).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fedjax_split.data.batch import Batch
from fedjax_split.data.batching import stack_clients
from fedjax_split.errors import UserError
from fedjax_split.fed.aggregation import Aggregator, aggregate
from fedjax_split.fed.client import (
    ClientFns,
    ClientMetrics,
    ClientSpec,
    ClientState,
    make_client_fns,
    real_steps,
)
from fedjax_split.fed.client_program import client_functions, client_rngs, download, round_rng
from fedjax_split.fed.fixed_point import EXTRA_FIELDS
from fedjax_split.fed.privacy import clip_upload
from fedjax_split.fed.roles import select
from fedjax_split.fed.server import ServerState, init_server_state, upload
from fedjax_split.fed.server_step import (
    checked_noise_key,
    server_only_step,
    server_round,
    server_step,
)
from fedjax_split.fed.strategy import sample_clients
from fedjax_split.fed.wire import cast_to_wire, param_count, tree_bytes, wire_dtype
from fedjax_split.sim import processes

# re-exported: rounds build on the server's state; sampling and the server's step are fed's
__all__ = ["ServerState", "init_server_state", "sample_clients", "server_round",
           "server_only_step", "checked_noise_key"]  # fmt: skip

CLIENT_AXIS = "clients"


class RoundResult(NamedTuple):
    """What one round reports besides the new states."""

    train_loss: jax.Array  # [K] mean data loss per sampled client over its real examples
    bytes_down: int  # server -> clients, all sampled clients together
    bytes_up: int  # clients -> server
    metrics: ClientMetrics  # stacked [K]
    accepted: jax.Array  # [K] bool: uploads the server took (a non-finite one is left out)
    update_norms: jax.Array  # [K] each update's L2 norm before clipping (0 unless clipped/robust)


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


class RoundProgress(NamedTuple):
    """How far a round's training has come, as far as the host has seen it finish."""

    clients_done: int  # sampled clients whose every step has finished
    clients: int  # sampled clients
    steps_done: int  # real local steps finished, all clients together (padded steps not counted)
    steps: int  # real local steps of the round
    examples_done: int  # training examples those steps consumed (an example once per epoch)


ProgressHook = Callable[[RoundProgress], None]


def real_counts(seg: Any) -> tuple[int, int]:
    """(real steps, examples) of one client's segment [S, ...] (a `Batch`, or anything with its
    example and step masks): the steps with examples that end there (a step of several parts
    counts at its last), and the examples of every real part; padding not counted."""
    rows = np.asarray(seg.example_mask).reshape(np.shape(seg.example_mask)[0], -1).sum(-1)
    real = rows > 0
    if seg.step_mask is not None:
        real &= np.asarray(seg.step_mask).reshape(-1)
    last = getattr(seg, "last_part", None)
    ends = real if last is None else real & np.asarray(last).reshape(-1)
    return int(ends.sum()), int(np.rint(rows[real].sum()))


class _Watcher:
    """Waits for a round's programs `lag` behind the latest enqueued and tells the hook what has
    finished (see the module's Progress)."""

    def __init__(self, hook: ProgressHook, segments: Sequence[Sequence[Batch]], lag: int) -> None:
        self.hook, self.lag = hook, lag
        self.counts = [[real_counts(s) for s in client] for client in segments]
        self.left = [len(client) for client in segments]
        self.steps = sum(n for client in self.counts for n, _ in client)
        self.done = [0, 0, 0]  # clients, steps, examples
        self.queue: collections.deque[tuple[jax.Array, list[tuple[int, int]]]] = (
            collections.deque()
        )

    def enqueued(self, state: ClientState, items: list[tuple[int, int]]) -> None:
        """`state`: the output of the program that ran segment j of client i for each (i, j) of
        `items`; read (a scalar) before another program takes it over."""
        self.queue.append((jnp.sum(state.steps), items))
        while len(self.queue) > self.lag:
            marker, finished = self.queue.popleft()
            jax.block_until_ready(marker)
            for i, j in finished:
                steps, examples = self.counts[i][j]
                self.left[i] -= 1
                self.done[0] += self.left[i] == 0
                self.done[1] += steps
                self.done[2] += examples
            clients, steps, examples = self.done
            self.hook(RoundProgress(clients, len(self.left), steps, self.steps, examples))


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


def client_keys(round_index: jax.Array, rng: jax.Array, client_ids: jax.Array) -> jax.Array:
    """Keys [K] of a round's sampled clients from the run's key (`fed.client_program`'s keys)."""
    return client_rngs(round_rng(rng, round_index), client_ids)


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

    def train(
        client_states: ClientState, received: Any, seg: Any, keys: jax.Array, constants: Any
    ):
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


@functools.lru_cache(maxsize=32)
def stacked_functions(spec: RoundSpec) -> StackedFns:
    """The jitted pieces of a stacked round for `spec` (cached per spec)."""
    if spec.mesh is not None and CLIENT_AXIS not in spec.mesh.axis_names:
        raise UserError(f"the mesh has axes {spec.mesh.axis_names}; name its axis '{CLIENT_AXIS}'")
    if spec.chunk_size is not None and spec.chunk_size < 1:
        raise UserError(f"chunk size must be >= 1, got {spec.chunk_size}; use a positive integer")
    wire = wire_dtype(spec.wire_dtype)
    fns = make_client_fns(spec.client)
    train = _train_stacked(spec, fns)
    num_devices = spec.mesh.devices.size if spec.mesh is not None else 1

    def shard(tree: Any) -> Any:
        if spec.mesh is None:
            return tree
        sharding = NamedSharding(spec.mesh, PartitionSpec(CLIENT_AXIS))
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)

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
        pad = keys.shape[0] - seg.step_mask.shape[0]
        data = _pad_clients(seg.replace(step_mask=None), pad).replace(
            step_mask=_pad_clients(seg.step_mask, pad, False)
        )
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


class OneAtATimeFns(NamedTuple):
    """A one-at-a-time round's pieces: the client program (`fed.client_program`: start_one,
    segment_one, finish_one, clip_one, each client's state in its own buffers), then
    combine(server_state, uploads, num_examples, noise_key, norms, factors) -> (server_state,
    (accepted, update norms)): `server_round` (uploads: a tuple in client order; norms: the
    clients' before DP's clipping, or None; factors: `tampered`'s, or None);
    stack(tuple of trees) -> [K'] (the trained clients' local parts, their metrics);
    keys(round, rng, client_ids) -> [K] keys."""

    start_one: Callable[..., Any]
    segment_one: Callable[..., Any]
    finish_one: Callable[..., Any]
    clip_one: Callable[..., Any]
    combine: Callable[..., Any]
    stack: Callable[..., Any]
    keys: Callable[..., Any]


def _stack(trees: tuple) -> Any:
    return jax.tree.map(lambda *x: jnp.stack(x), *trees)


@functools.lru_cache(maxsize=32)
def one_at_a_time_functions(spec: RoundSpec) -> OneAtATimeFns:
    """The pieces of a one-at-a-time round for `spec` (cached per spec): the very programs
    `fed.client_program.client_round` runs, and the server's step (`server_round`)."""
    return OneAtATimeFns(
        *client_functions(spec),
        functools.partial(server_round, spec),
        jax.jit(_stack),
        jax.jit(client_keys),
    )


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


def _run_one_at_a_time(
    fns: OneAtATimeFns,
    devices: tuple[Any, ...],
    server_state: ServerState,
    local_params: Any,
    ids: jax.Array,
    rng: jax.Array,
    noise_key: jax.Array,
    segments: Sequence[Sequence[Batch] | None],
    weights: np.ndarray,
    frozen: Any,
    on_progress: ProgressHook | None = None,
    factors: Any = None,
    local_like: Any = None,
    totals: Sequence[int | None] | None = None,
) -> tuple[ServerState, Any, ClientMetrics, Any]:
    """One-at-a-time round with client i on devices[i % D]: each device runs its clients one
    after another while the other devices run theirs. Each client runs the client program
    (`fed.client_program`) on its own steps; the uploads are summed in client order.

    Why several devices: on a CPU, two streams of small client steps keep both cores busier than
    one stream whose every op is split across them (docs/benchmarks.md measures it). With
    several processes (`sim.processes`) `devices` spans them all: this process trains the
    clients dealt to its devices (`local_params` and `segments` hold only theirs: the others'
    segments may be None), the uploads and figures of all are gathered in client order, and
    every process aggregates them alike; the local parts returned are this process's clients'.
    """
    num, num_devices = len(weights), len(devices)
    owner = processes.owners(devices, num)
    mine = [i for i in range(num) if owner[i] == processes.index()]
    slot = {i: k for k, i in enumerate(mine)}  # row of local_params
    used = sorted({i % num_devices for i in mine})
    watcher = None if on_progress is None else _Watcher(
        on_progress, [segments[i] for i in mine], min(len(mine), len(used))
    )  # fmt: skip
    keys = fns.keys(server_state.round, rng, ids)
    # the received global part and the frozen one, put once on each device that has clients
    here = {d: jax.device_put((server_state.global_params, frozen), devices[d]) for d in used}
    states, own_keys = _start_clients(fns, devices, here, keys, mine, local_params, totals)
    # Programs are enqueued one per device in turn (client d's first step, client d + 1's on the
    # next device, ...), so that no device waits for the host to reach its clients; the host only
    # enqueues, it reads nothing back.
    for first in range(0, len(mine), max(len(used), 1)):
        group = mine[first : first + len(used)]
        for j in range(max(len(segments[i]) for i in group)):
            for i in group:
                if j < len(segments[i]):
                    global_wire, frozen_there = here[i % num_devices]
                    seg = jax.device_put(segments[i][j].for_training(), devices[i % num_devices])
                    states[i] = fns.segment_one(states[i], global_wire, seg, own_keys[i],
                                                frozen_there)  # fmt: skip
                    if watcher is not None:
                        watcher.enqueued(states[i], [(slot[i], j)])
    dp = bool(server_state.aggregator)  # client-level DP: each client clips its update itself
    sent, locals_ = {}, []
    for i in mine:
        upload_i, local_i, metrics_i = fns.finish_one(states[i])
        if dp:
            global_wire, _ = here[i % num_devices]
            bound = jax.device_put(server_state.aggregator["clip"], devices[i % num_devices])
            upload_i, norm = fns.clip_one(upload_i, global_wire, bound)
            sent[i] = (upload_i, metrics_i, norm)
        else:
            sent[i] = (upload_i, metrics_i)
        locals_.append(local_i)
    like = None
    if not mine and processes.count() > 1:
        like = _sent_like(fns, server_state, local_like, keys[0], dp)
    at = jax.local_devices()[0] if processes.count() > 1 else devices[0]
    received = jax.device_put(processes.gather_clients(sent, owner, like), at)
    uploads, metrics, *norms = zip(*received, strict=True)
    state, checks = fns.combine(jax.device_put(server_state, at), uploads, weights, noise_key,
                                jnp.stack(norms[0]) if dp else None, factors)  # fmt: skip
    metrics = fns.stack(metrics)
    new_local = fns.stack(tuple(jax.device_put(locals_, at))) if locals_ else None
    return state, new_local, metrics, checks


def _start_clients(
    fns: OneAtATimeFns,
    devices: tuple[Any, ...],
    here: dict[int, Any],
    keys: jax.Array,
    mine: Sequence[int],
    local_params: Any,
    totals: Sequence[int | None] | None,
) -> tuple[dict[int, Any], dict[int, Any]]:
    """The client states of this process's clients `mine`, each on its device (client i on
    devices[i % D], its local part row k of `local_params` for the k-th of `mine`), and their
    keys there; `totals`: each client's steps this round for a linear client schedule, or None."""
    states: dict[int, Any] = {}
    own_keys: dict[int, Any] = {}
    for k, i in enumerate(mine):
        device = devices[i % len(devices)]
        local = jax.device_put(jax.tree.map(lambda x, k=k: x[k], local_params), device)
        own_keys[i] = jax.device_put(keys[i], device)
        total = None if totals is None else jnp.int32(totals[i])
        states[i] = fns.start_one(here[i % len(devices)][0], local, own_keys[i], total)
    return states, own_keys


def _sent_like(
    fns: OneAtATimeFns, server_state: ServerState, local_like: Any, key: jax.Array, dp: bool
) -> Any:
    """The shapes of what a client sends (upload, metrics[, norm]), for a process that trained
    none of the round's clients; `local_like`: a client's local part's shapes."""
    def sent(global_wire: Any, local: Any, k: jax.Array, bound: Any) -> Any:
        steps = jnp.zeros([], jnp.int32)  # shapes only: any count of steps
        upload_i, _, metrics_i = fns.finish_one(fns.start_one(global_wire, local, k, steps))
        if not dp:
            return upload_i, metrics_i
        clipped, norm = fns.clip_one(upload_i, global_wire, bound)
        return clipped, metrics_i, norm

    bound = server_state.aggregator.get("clip") if dp else None
    return jax.eval_shape(sent, server_state.global_params, local_like, key, bound)


def _run_stacked(
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
    watcher = None if on_progress is None else _Watcher(on_progress, segments, 1)
    steps = None if totals is None else jnp.asarray(totals, jnp.int32)
    client_states, keys = fns.start(server_state, local_params, ids, rng, steps)
    for j, seg in enumerate(stack_clients(segments)):
        seg = seg.for_training()
        client_states = fns.segment(client_states, server_state.global_params, seg, keys, frozen)
        if watcher is not None:
            watcher.enqueued(client_states, [(i, j) for i, c in enumerate(segments) if j < len(c)])
    return fns.finish(server_state, client_states, weights, noise_key, factors)


def client_bytes(spec: RoundSpec, global_params: Any) -> tuple[int, int]:
    """(bytes down, bytes up) of one sampled client in a round: the global part in the wire dtype
    down (a client needs the whole current global part), its trained part up. Frozen and local
    parameters are never sent. Works on arrays or shape structs."""
    sent = jax.eval_shape(lambda g: cast_to_wire(g, spec.wire_dtype), global_params)
    up = select(sent, spec.trained)[0]
    if spec.aggregator.secure:  # the masked fixed-point vector: 8 bytes an entry, two more
        return tree_bytes(sent), 8 * (param_count(up) + EXTRA_FIELDS)
    return tree_bytes(sent), tree_bytes(up)


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
      on_progress: called with a `RoundProgress` as the clients' programs finish (the module's
        Progress); None: the host waits for nothing.
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
    weights = np.asarray(num_examples)
    if weights.ndim != 1 or not np.all(weights >= 0) or (len(weights) and weights.sum() <= 0):
        raise UserError(
            f"num_examples must be K non-negative counts with a positive sum, got {weights}"
        )
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
    ids = jnp.asarray(client_ids, jnp.int32)
    factors = None if update_factors is None else jnp.asarray(update_factors, jnp.float32)
    if processes.count() > 1 and local_like is None:  # every process stops, none waits
        raise ValueError("run_round with several processes needs local_like")
    # each client's steps this round, counted on the host, for a linear client schedule (its
    # optimiser ignores them otherwise)
    totals = [None if c is None else int(real_steps(c, np)) for c in segments]
    if one_at_a_time(spec):
        state, new_local, metrics, (accepted, norms) = _run_one_at_a_time(
            one_at_a_time_functions(spec), round_devices(spec), server_state, local_params, ids,
            rng, noise_key, segments, weights, frozen, on_progress, factors, local_like, totals,
        )  # fmt: skip
    else:
        if processes.count() > 1:
            raise UserError("several processes train one client at a time: use chunk_size=1")
        state, new_local, metrics, (accepted, norms) = _run_stacked(
            stacked_functions(spec), server_state, local_params, ids, rng, noise_key, segments,
            weights, frozen, on_progress, factors, totals,
        )  # fmt: skip
    train_loss = metrics.loss_sum / jnp.maximum(metrics.num_examples, 1.0)
    result = RoundResult(
        train_loss, per_client_down * num_sampled, per_client_up * num_sampled, metrics,
        accepted, norms,
    )  # fmt: skip
    return state, new_local, result


def _run_nobody(
    spec: RoundSpec, server_state: ServerState, local_params: Any, noise_key: jax.Array
) -> tuple[ServerState, Any, RoundResult]:
    """A round without clients: the server's step alone, nothing sent, empty [0] figures."""
    empty = jnp.zeros([0], jnp.float32)
    metrics = ClientMetrics(empty, empty, jnp.zeros([0], jnp.int32))
    result = RoundResult(empty, 0, 0, metrics, jnp.zeros([0], bool), empty)
    return server_only_step(spec)(server_state, noise_key), local_params, result
