"""The one-at-a-time execution of a round (`one_at_a_time_functions`; `chunk_size=1` and no
mesh): each client runs the client program (`fed.client_program.client_round`'s pieces) with its
state in its own buffers for the whole round, and `combine` aggregates the uploads: the host only
enqueues the client's step programs (no device-to-host transfer inside the round), and a client of
a real federation (`fedjax_split.deploy`) computes the same model bit for bit. With several
devices (`RoundSpec.devices`, by default every local one: on a CPU see
`devices.use_cpu_devices`), client i runs on device i % D, all devices at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_split.data.batch import Batch
from fedjax_split.fed.client import ClientMetrics
from fedjax_split.fed.client_program import client_functions
from fedjax_split.fed.server import ServerState
from fedjax_split.fed.server_step import server_round
from fedjax_split.sim import processes
from fedjax_split.sim.round_progress import ProgressHook, Watcher
from fedjax_split.sim.round_spec import RoundSpec, client_keys


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


def run_one_at_a_time(
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
    used = sorted({i % num_devices for i in mine})
    watcher = None if on_progress is None else Watcher(
        on_progress, [segments[i] for i in mine], min(len(mine), len(used))
    )  # fmt: skip
    keys = fns.keys(server_state.round, rng, ids)
    # the received global part and the frozen one, put once on each device that has clients
    here = {d: jax.device_put((server_state.global_params, frozen), devices[d]) for d in used}
    states, own_keys = _start_clients(fns, devices, here, keys, mine, local_params, totals)
    _enqueue_steps(fns, devices, here, segments, states, own_keys, mine, len(used), watcher)
    dp = bool(server_state.aggregator)  # client-level DP: each client clips its update itself
    sent, locals_ = _finish_clients(fns, devices, here, server_state, states, mine, dp)
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


def _enqueue_steps(
    fns: OneAtATimeFns,
    devices: tuple[Any, ...],
    here: dict[int, Any],
    segments: Sequence[Sequence[Batch] | None],
    states: dict[int, Any],
    own_keys: dict[int, Any],
    mine: Sequence[int],
    num_used: int,
    watcher: Watcher | None,
) -> None:
    """Enqueues the segment programs of this process's clients `mine`, updating `states` in
    place: one per device in turn (client d's first step, client d + 1's on the next device, ...),
    so that no device waits for the host to reach its clients; the host only enqueues, it reads
    nothing back (but for `watcher`'s waits)."""
    num_devices = len(devices)
    slot = {i: k for k, i in enumerate(mine)}  # row of local_params
    for first in range(0, len(mine), max(num_used, 1)):
        group = mine[first : first + num_used]
        for j in range(max(len(segments[i]) for i in group)):
            for i in group:
                if j < len(segments[i]):
                    global_wire, frozen_there = here[i % num_devices]
                    seg = jax.device_put(segments[i][j].for_training(), devices[i % num_devices])
                    states[i] = fns.segment_one(states[i], global_wire, seg, own_keys[i],
                                                frozen_there)  # fmt: skip
                    if watcher is not None:
                        watcher.enqueued(states[i], [(slot[i], j)])


def _finish_clients(
    fns: OneAtATimeFns,
    devices: tuple[Any, ...],
    here: dict[int, Any],
    server_state: ServerState,
    states: dict[int, Any],
    mine: Sequence[int],
    dp: bool,
) -> tuple[dict[int, tuple], list[Any]]:
    """What each of this process's clients sends, by client (upload, metrics[, norm before
    clipping]: with client-level DP each client clips its update itself), and their new local
    parts in client order."""
    num_devices = len(devices)
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
    return sent, locals_


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
