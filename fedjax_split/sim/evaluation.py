"""Personalised evaluation: each client's merged model [global, own local] on its own test split.

The paper reports the mean over clients of each client's metric. Each client's test examples are
its own batches (`batching.client_eval_batches`); its model scores them one jitted call per batch
(one compile per batch shape), padding rows are dropped on the host, and the caller turns
(predictions, labels) into metrics (`tasks.compute_metrics`), e.g. with `client_metrics`. Clients
are scored one after another, so memory holds one client's local part at a time whatever K is.
`evaluate_pooled` scores a single model on the union of the clients' test data (FedNLP's figure
for a global model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fedjax_split.data.batch import Batch, apply_batch
from fedjax_split.fed.roles import merge_params
from fedjax_split.tasks.objectives import IGNORE

Apply = Callable[..., jax.Array]


class ClientPredictions(NamedTuple):
    """One client's predictions (class ids, scores for regression, or per-token class ids [n, T]
    with labels IGNORE where no label is) and labels, real rows only."""

    predictions: np.ndarray
    labels: np.ndarray
    example_index: np.ndarray | None = None  # pool index of each row, when batches carry it


@functools.lru_cache(maxsize=32)
def _predict_fn(apply: Apply, objective: Any):
    def predict(params: Any, steps: Batch) -> jax.Array:
        return jax.lax.map(lambda b: objective.predict(apply_batch(apply, params, b, train=False)),
                           steps)  # fmt: skip

    return jax.jit(predict)


def evaluate_client(
    apply: Apply, params: Any, batches: Sequence[Batch], objective: Any
) -> ClientPredictions:
    """Predictions of one model (a client's merged parameters) on its batches [S, B, ...]."""
    predict = _predict_fn(apply, objective)
    parts: dict[str, list[np.ndarray]] = {"predictions": [], "labels": [], "example_index": []}
    for batch in batches:
        real = (np.asarray(batch.example_mask) > 0) & np.asarray(batch.step_mask)[..., None]
        predictions = np.asarray(predict(params, batch.model_inputs()))
        labels = np.asarray(batch.labels)
        if batch.packed and labels.shape == batch.input_ids.shape:  # per-token, on the stream
            predictions, labels = (_rows_of_stream(batch, x) for x in (predictions, labels))
        parts["predictions"].append(predictions[real])
        parts["labels"].append(labels[real])
        if batch.example_index is not None:
            parts["example_index"].append(np.asarray(batch.example_index)[real])
    if not parts["predictions"]:
        empty = np.zeros(0)
        return ClientPredictions(empty, empty, empty.astype(np.int64))
    index = concat_rows(parts["example_index"]) if parts["example_index"] else None
    return ClientPredictions(concat_rows(parts["predictions"]), concat_rows(parts["labels"]), index)


def _rows_of_stream(batch: Batch, stream: np.ndarray) -> np.ndarray:
    """A packed batch's per-token values [S, N] as per-example rows [S, B, T] (T: the longest
    example; IGNORE after each example's end), so they score like a padded batch's."""
    slots = np.asarray(batch.attention_mask)  # [S, R, W]: example number + 1, 0 = empty
    starts = np.asarray(batch.cls_index)  # [S, B]
    num_steps, width = starts.shape
    lengths = np.stack([np.bincount(slots[s].reshape(-1), minlength=width + 1)[1:]
                        for s in range(num_steps)])  # fmt: skip
    rows = np.full((num_steps, width, max(int(lengths.max(initial=0)), 1)), IGNORE, stream.dtype)
    for s in range(num_steps):
        for b in range(width):
            n = lengths[s, b]
            rows[s, b, :n] = stream[s, starts[s, b] : starts[s, b] + n]
    return rows


def evaluate_clients(
    apply: Apply,
    global_params: Any,
    local_params: Any,
    batches: Sequence[Sequence[Batch]],
    objective: Any,
) -> list[ClientPredictions]:
    """Every client's personalised model on its own batches.

    `local_params` is stacked on a leading client axis K ({} when nothing is local); `batches`
    holds each client's test batches (`batching.client_eval_batches`). Returns K results.
    """
    results = []
    for k, own in enumerate(batches):
        local = jax.tree.map(lambda x, k=k: x[k], local_params)
        results.append(evaluate_client(apply, merge_params(global_params, local), own, objective))
    return results


def concat_rows(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Rows of all batches; per-token rows [n, T] of batches of different T are right-padded
    to the longest with IGNORE (a label no metric reads)."""
    width = max((p.shape[1] for p in parts if p.ndim == 2), default=None)
    if width is None:
        return np.concatenate(parts)
    return np.concatenate(
        [np.pad(p, ((0, 0), (0, width - p.shape[1])), constant_values=IGNORE) for p in parts]
    )


def evaluate_pooled(
    apply: Apply, params: Any, batches: Sequence[Sequence[Batch]], objective: Any
) -> ClientPredictions:
    """One model on the union of all clients' test rows (the clients' batches, any number)."""
    per_client = [evaluate_client(apply, params, own, objective) for own in batches]
    has_index = all(c.example_index is not None for c in per_client)
    return ClientPredictions(
        concat_rows([c.predictions for c in per_client]),
        concat_rows([c.labels for c in per_client]),
        np.concatenate([c.example_index for c in per_client]) if has_index else None,
    )


def client_metrics(
    results: Sequence[ClientPredictions],
    metric_fn: Callable[[np.ndarray, np.ndarray], Mapping[str, float]],
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Per-client metrics and their unweighted mean over clients (the paper's reported figure).

    `metric_fn(predictions, labels)`, e.g. `functools.partial(tasks.compute_metrics, task)`.
    Clients without test rows are skipped.
    """
    per_client = [dict(metric_fn(r.predictions, r.labels)) for r in results if len(r.labels)]
    names = per_client[0].keys() if per_client else ()
    mean = {name: float(np.mean([m[name] for m in per_client])) for name in names}
    return per_client, mean
