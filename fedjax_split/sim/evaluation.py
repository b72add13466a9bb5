"""Personalised evaluation: each client's merged model [global, own local] on its own test split.

The paper reports the mean over clients of each client's metric. Predictions are computed for all
clients in one vmapped, jitted call per segment; padding rows and padded steps are dropped on the
host, and the caller turns (predictions, labels) into metrics (`tasks.compute_metrics`), e.g. with
`client_metrics`. When the split leaves no local part, `evaluate_pooled` scores the single global
model on the union of the clients' test data.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fedjax_split.data.batch import Batch, apply_batch
from fedjax_split.data.objectives import IGNORE
from fedjax_split.fed.roles import merge_params

Apply = Callable[..., jax.Array]


class ClientPredictions(NamedTuple):
    """One client's predictions (class ids, scores for regression, or per-token class ids [n, T]
    with labels IGNORE where no label is) and labels, real rows only."""

    predictions: np.ndarray
    labels: np.ndarray
    example_index: np.ndarray | None = None  # pool index of each row, when segments carry it


@functools.lru_cache(maxsize=32)
def _predict_fn(apply: Apply, objective: Any, chunk_size: int | None):
    def one_client(global_params: Any, local: Any, seg: Batch) -> jax.Array:
        params = merge_params(global_params, local)

        def one_step(batch: Batch) -> jax.Array:
            return objective.predict(apply_batch(apply, params, batch, train=False))

        return jax.lax.map(one_step, seg)

    def predict(global_params: Any, local_params: Any, seg: Batch) -> jax.Array:
        fn = functools.partial(one_client, global_params)
        if chunk_size is None:
            return jax.vmap(fn)(local_params, seg)
        return jax.lax.map(lambda a: fn(*a), (local_params, seg), batch_size=chunk_size)

    return jax.jit(predict)


def evaluate_clients(
    apply: Apply,
    global_params: Any,
    local_params: Any,
    segments: Sequence[Batch],
    objective: Any,
    *,
    chunk_size: int | None = None,
) -> list[ClientPredictions]:
    """Predictions of every client's personalised model on its own segments.

    `local_params` is stacked on a leading client axis K ({} when nothing is local); `segments` are
    batching's segments of the clients' test splits ([K, S, B, T] ...). Returns K results.
    """
    columns: list[dict[str, list[np.ndarray]]] = []
    predict = _predict_fn(apply, objective, chunk_size)
    for seg in segments:
        predictions = predict(global_params, local_params, seg.model_inputs())
        rows = {"predictions": np.asarray(predictions), "labels": np.asarray(seg.labels)}
        if seg.example_index is not None:
            rows["example_index"] = np.asarray(seg.example_index)
        real = (np.asarray(seg.example_mask) > 0) & np.asarray(seg.step_mask)[:, :, None]
        if not columns:
            columns = [{name: [] for name in rows} for _ in range(real.shape[0])]
        for k, client in enumerate(columns):
            for name, values in rows.items():
                client[name].append(values[k][real[k]])
    return [
        ClientPredictions(**{name: _concat(parts) for name, parts in client.items()})
        for client in columns
    ]


def _concat(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Rows of all segments; per-token rows [n, T] of segments of different T are right-padded
    to the longest with IGNORE (a label no metric reads)."""
    width = max((p.shape[1] for p in parts if p.ndim == 2), default=None)
    if width is None:
        return np.concatenate(parts)
    return np.concatenate(
        [np.pad(p, ((0, 0), (0, width - p.shape[1])), constant_values=IGNORE) for p in parts]
    )


def evaluate_pooled(
    apply: Apply,
    params: Any,
    segments: Sequence[Batch],
    objective: Any,
    *,
    chunk_size: int | None = None,
) -> ClientPredictions:
    """The one global model (no local part) on the union of all clients' test rows."""
    per_client = evaluate_clients(apply, params, {}, segments, objective, chunk_size=chunk_size)
    has_index = all(c.example_index is not None for c in per_client)
    return ClientPredictions(
        np.concatenate([c.predictions for c in per_client]),
        np.concatenate([c.labels for c in per_client]),
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
