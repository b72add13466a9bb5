"""One round of federated further pre-training (MLM), clients one after another, and the
held-out evaluation.

A round follows the run's `fed.strategy.Strategy`'s plan: each client assembles its model from
the global parameters it received (`layerwise.assemble`: FedBFPT's small model, or the first k
layers, or the whole model), trains the parameters the plan names with `fed.client`'s update
(everything else enters as constants: no gradient, no optimiser state), and uploads them renamed
to their global paths. The strategy's server step (fine-tuning's, `fed.server_step`) averages the
uploads (example-weighted, or unweighted as the released FedBFPT code does) and steps only those
paths: every other parameter and its optimiser state stay exactly put.

Costs are counted per client: `bytes_up` from the arrays sent (the trained part in the wire
dtype), matmul FLOPs from `models.flops.mlm_train_flops` for the steps it ran, and the seconds
its training took (dispatch to ready, compilation included the first time a shape is seen), as
wall time and as this process' CPU time (steadier where other processes share the cores).

Keys: a client's dropout key is fold_in(fold_in(key(seed), round), client id), its k-th real
step's fold_in(that, k) (`fed.client.step_rng`), as in `fed.client_program`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_split.data.batch import apply_batch
from fedjax_split.data.text.masking import MaskedBatch
from fedjax_split.fed import layerwise
from fedjax_split.fed.client import ClientSpec
from fedjax_split.fed.client_program import client_round
from fedjax_split.fed.roles import layer_index
from fedjax_split.fed.server import ServerState
from fedjax_split.fed.strategy import RoundPlan, Strategy
from fedjax_split.fed.wire import cast_to_wire, tree_bytes
from fedjax_split.models.bert import BertConfig, make_apply
from fedjax_split.models.flops import mlm_train_flops
from fedjax_split.sim.round_progress import ProgressHook, RoundProgress, real_counts
from fedjax_split.sim.round_spec import RoundSpec
from fedjax_split.tasks.objectives import IGNORE, MASKED_LM


class ClientReport(NamedTuple):
    """One client's round."""

    client: int
    layers: tuple[int, ...]  # the global layer at each position of its model
    loss: float  # mean MLM loss over its predicted tokens
    tokens: int  # tokens it predicted (all steps)
    steps: int  # real optimiser steps
    seconds: float  # wall time
    cpu_seconds: float  # this process' CPU time (all threads): steadier on a shared machine
    flops: int  # matmul FLOPs of its steps (models.flops.mlm_train_flops)
    bytes_up: int


class Trainer:
    """What a round's clients run, per model depth (clients may run models of another depth than
    the server's: FedBFPT's small ones) and trained set: a `sim.round_spec.RoundSpec` whose global
    part is the client's whole model, of which `trained` is trained and sent, so that a client
    runs `fed.client_program.client_round`, the programs every federated client of this library
    runs."""

    def __init__(
        self,
        config: BertConfig,
        optimizer: optax.GradientTransformation,
        server_optimizer: optax.GradientTransformation | None = None,
        wire_dtype: str = "float32",
    ) -> None:
        self.config = config  # the global model's (head "mlm")
        self.optimizer = optimizer
        self.server_optimizer = server_optimizer or optax.sgd(1.0)  # FedAvg
        self.wire_dtype = wire_dtype
        self._specs: dict[tuple[int, frozenset[str]], RoundSpec] = {}

    def depth_config(self, depth: int) -> BertConfig:
        return dataclasses.replace(self.config, num_hidden_layers=depth)

    def spec(self, depth: int, trained: frozenset[str]) -> RoundSpec:
        """The round spec of a `depth`-layer client model training the paths `trained` (of
        that model); one per (depth, trained), so each compiles once."""
        if (depth, trained) not in self._specs:
            same_depth = [v for (d, _), v in self._specs.items() if d == depth]
            client = (
                same_depth[0].client
                if same_depth
                else ClientSpec(make_apply(self.depth_config(depth)), MASKED_LM, self.optimizer)
            )
            self._specs[(depth, trained)] = RoundSpec(
                client=client, server_optimizer=self.server_optimizer,
                wire_dtype=self.wire_dtype, chunk_size=1, trained=trained,
            )  # fmt: skip
        return self._specs[(depth, trained)]

    def server_spec(self, trained: frozenset[str]) -> RoundSpec:
        """The server's step of a round training the global paths `trained`
        (`fed.strategy.Strategy`'s round spec): FedAvg's mean, the server optimizer on those paths
        alone. No donation: a transport reads the round's starting parameters after the step."""
        return dataclasses.replace(
            self.spec(self.config.num_hidden_layers, trained), donate=False
        )


def step_flops(config: BertConfig, batch: MaskedBatch, depth: int,
               client_paths: frozenset[str]) -> int:  # fmt: skip
    """Matmul FLOPs of one step on `batch` ([S, B, T] or [B, T]) of a `depth`-layer model whose
    trained parameters are `client_paths` (paths of that model)."""
    b, t = batch.input_ids.shape[-2:]
    trained_layers = {layer_index(q) for q in client_paths} - {None}
    return mlm_train_flops(
        config, b, t, batch.positions.shape[-1],
        layers=depth,
        trained_layers=trained_layers,
        embeddings_trained="embeddings/word_embeddings/embedding" in client_paths,
        head_trained=any(q.startswith("mlm/transform/") for q in client_paths),
    )  # fmt: skip


class RoundOutcome(NamedTuple):
    state: ServerState
    clients: list[ClientReport]
    bytes_up: int
    rejected: list[int]  # clients whose upload the server's step left out (not finite)


def client_key(seed: int, round_: int, client: int) -> jax.Array:
    """Client `client`'s dropout key in round `round_`: fold_in(fold_in(key(seed), round), c)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), round_), client)


def client_update(
    trainer: Trainer,
    global_wire: Mapping[str, Any],
    layers: Sequence[int],
    trained: frozenset[str],
    segments: Sequence[MaskedBatch],
    key: jax.Array,
    client: int,
) -> tuple[dict[str, Any], ClientReport]:
    """One client's round as it runs wherever the client is (this process, or a Flower node):
    (its upload under global paths, fp32, before the wire's cast; its report). `global_wire`:
    the server's global parameters in the wire dtype, of which the client receives the layers it
    runs (`layerwise.assemble`), the embeddings and the head."""
    client_paths = layerwise.paths_to_client(trained, layers)
    t0, c0 = time.perf_counter(), time.process_time()
    spec = trainer.spec(len(layers), client_paths)
    trained_part, _, metrics = client_round(
        spec, layerwise.assemble(global_wire, layers), {}, segments, key
    )
    new = layerwise.to_global(trained_part, layers)
    sent = cast_to_wire(new, trainer.wire_dtype)  # what crosses the wire
    jax.block_until_ready(sent)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    count = metrics.num_examples
    flops = sum(
        int(np.sum(np.asarray(s.step_mask) & (np.asarray(s.example_mask).sum(-1) > 0)))
        * step_flops(trainer.config, s, len(layers), client_paths)
        for s in segments
    )
    report = ClientReport(
        client=int(client),
        layers=tuple(int(x) for x in layers),
        loss=float(metrics.loss_sum / jnp.maximum(count, 1.0)),
        tokens=int(count),
        steps=int(metrics.num_steps),
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        flops=int(flops),
        bytes_up=tree_bytes(sent),
    )
    return new, report


def run_round(
    trainer: Trainer,
    strategy: Strategy,
    state: ServerState,
    plan: RoundPlan,
    segments: Sequence[Sequence[MaskedBatch]],
    weights: Sequence[float],
    *,
    seed: int,
    on_progress: ProgressHook | None = None,
) -> RoundOutcome:
    """Trains every client of `plan` in turn (the layers its model runs, the plan's trained
    paths), then `strategy`'s server step over their uploads with `weights` (only the trained
    paths move). `on_progress` hears each client's end (`sim.round_progress.RoundProgress`;
    clients are waited for anyway, to time them)."""
    clients = [int(c) for c in plan.clients]
    layers_of = plan.layers or [tuple(range(trainer.config.num_hidden_layers))] * len(clients)
    uploads, reports = [], []
    # (real steps, sequences) done after each client, for the hook only
    counts = None if on_progress is None else np.cumsum(
        [np.sum([real_counts(s) for s in segs] or [(0, 0)], axis=0) for segs in segments], axis=0
    )  # fmt: skip
    for c, layers, segs in zip(clients, layers_of, segments, strict=True):
        key = client_key(seed, plan.round, c)
        new, report = client_update(
            trainer, state.global_params, layers, plan.trained, segs, key, c
        )
        uploads.append(new)
        reports.append(report)
        if counts is not None:
            done, examples = counts[len(reports) - 1]
            on_progress(RoundProgress(len(reports), len(clients), int(done),
                                      int(counts[-1][0]), int(examples)))  # fmt: skip
    state, accepted, _ = strategy.aggregate(plan, state, uploads, np.asarray(weights, np.float32))
    rejected = [c for c, ok in zip(clients, np.asarray(accepted), strict=True) if not ok]
    return RoundOutcome(state, reports, sum(r.bytes_up for r in reports), rejected)


@functools.cache
def _eval_step(config: BertConfig) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
    apply = make_apply(config)

    @jax.jit
    def step(params: Any, batch: MaskedBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
        logits = apply_batch(apply, params, batch.model_inputs(), train=False)
        loss_sum, count = MASKED_LM.loss_sums(logits, batch.labels, batch.example_mask)
        labelled = (batch.labels != -100) & (batch.example_mask[:, None] > 0)
        correct = jnp.sum((MASKED_LM.predict(logits) == batch.labels) & labelled)
        return loss_sum, count, correct

    return step


def eval_sums(
    config: BertConfig, params: Mapping[str, Any], batches: Sequence[MaskedBatch]
) -> np.ndarray:
    """Per held-out batch: [loss sum, predicted tokens, correct predictions] (float64 [n, 3]) of
    `params` (a model of `config`'s depth). Batches may be scored in different places (Flower's
    nodes) and their rows put together in batch order for `mlm_metrics`."""
    step = _eval_step(config)
    rows = [[float(x) for x in step(params, batch)] for batch in batches]
    return np.asarray(rows, np.float64).reshape(len(rows), 3)


def mlm_metrics(sums: np.ndarray) -> dict[str, float]:
    """MLM loss (mean over predicted tokens) and masked-token accuracy from `eval_sums`' rows,
    summed in batch order."""
    totals = np.zeros(3)
    for row in np.asarray(sums, np.float64).reshape(-1, 3):
        totals += row
    loss_sum, count, correct = totals
    n = max(count, 1.0)
    return {"mlm_loss": loss_sum / n, "mlm_accuracy": correct / n, "predicted_tokens": int(count)}


def unigram_level(batches: Sequence[MaskedBatch]) -> dict[str, float | int]:
    """What predicting from token frequencies alone reaches on these held-out batches: the
    accuracy of always predicting their most frequent target token, and the loss (nats) of
    predicting their own target frequencies, the entropy. A model scoring near these has learnt
    token frequencies, not a contextual masked LM."""
    labels = [np.asarray(b.labels)[(np.asarray(b.example_mask) > 0)] for b in batches]
    flat = np.concatenate([x.reshape(-1) for x in labels]) if labels else np.zeros(0, np.int64)
    flat = flat[flat != IGNORE]
    if flat.size == 0:
        return {"unigram_accuracy": 0.0, "unigram_loss": 0.0, "predicted_tokens": 0}
    counts = np.bincount(flat)
    p = counts[counts > 0] / flat.size
    return {
        "unigram_accuracy": float(counts.max() / flat.size),
        "unigram_loss": float(-(p * np.log(p)).sum()),
        "predicted_tokens": int(flat.size),
    }


def evaluate(
    config: BertConfig, params: Mapping[str, Any], batches: Sequence[MaskedBatch]
) -> dict[str, float]:
    """MLM loss (mean over predicted tokens) and masked-token accuracy of `params` (a model of
    `config`'s depth) on held-out batches."""
    return mlm_metrics(eval_sums(config, params, batches))
