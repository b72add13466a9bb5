"""TEMPORARY: the per-client pieces the node needs, on today's simulation code.

Removed when main's per-client batching lands (rounds.client_round / client_key,
batching.client_batches / client_eval_batches, evaluation.evaluate_client). Until then a node's
batches are NOT the simulation's: today's bucketing shares cut points across the round's clients.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def client_key(run_rng: jax.Array, round_index: int, client_id: int) -> jax.Array:
    from fedjax_split.sim import rounds

    return jax.random.fold_in(rounds.round_rng(run_rng, round_index), client_id)


def client_steps(config, task, tokenized, labels, row_width, indices, client_id, r) -> list:
    from fedjax_split.data import batching

    segs = batching.make_client_batches(
        tokenized,
        [indices],
        labels,
        batch_size=config.batch_size,
        epochs=config.local_epochs,
        seed=[config.seed, r],
        objective=task.objective,
        client_ids=[client_id],
        packing=config.packing,
    )
    return [parts[0] for parts in batching.client_segments(segs) if parts[0] is not None]


def client_round(spec, global_wire, local, steps, run_rng, client_id, state_round, frozen):
    from fedjax_split.fed.server import ServerState
    from fedjax_split.sim import rounds

    fns = rounds.round_functions(spec)
    state = ServerState(global_wire, {}, (), jnp.asarray(state_round, jnp.int32))
    stacked = jax.tree.map(lambda x: jnp.asarray(x)[None], local)
    ids = jnp.asarray([client_id], jnp.int32)
    states, keys = fns.start_each(state, stacked, ids, run_rng)
    one = states[0]
    for step in steps:
        one = fns.segment_one(one, state, step.for_training(), keys[0], frozen)
    return fns.finish_one(one)


def evaluate(node, global_wire, local) -> dict[str, Any]:
    from fedjax_split.data import batching, tasks
    from fedjax_split.fed import roles, wire
    from fedjax_split.sim import evaluation

    segs = batching.make_eval_batches(
        node.tokenized,
        [node.split.test],
        node.labels,
        batch_size=max(node.config.batch_size, 32),
        objective=node.task.objective,
    )
    received = roles.merge_params(wire.cast_from_wire(global_wire, jnp.float32), node.frozen)
    stacked = jax.tree.map(lambda x: jnp.asarray(x)[None], local)
    (res,) = evaluation.evaluate_clients(
        node.apply, received, stacked, segs, node.task.objective, chunk_size=node.config.chunk_size
    )
    if len(res.labels) == 0:
        return {}
    groups = getattr(node.examples, "groups", None)
    return tasks.compute_metrics(
        node.task,
        res.predictions,
        res.labels,
        groups=None if groups is None else np.asarray(groups)[res.example_index],
        label_names=getattr(node.examples, "tag_names", None),
    )
