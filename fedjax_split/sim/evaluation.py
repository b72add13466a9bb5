"""Personalised evaluation: each client's merged model [global, own local] on its own test split.

The paper reports the mean over clients of each client's metric. Each client's test examples are
its own batches (`batching.client_eval_batches`); a model scores them one jitted call per batch
(one compile per batch shape), padding rows are dropped on the host, and the caller turns
(predictions, labels) into metrics (`tasks.compute_metrics`), e.g. with `client_metrics`.

`evaluate_client` scores one client (what a Flower node runs). `evaluate_personalised` scores many,
batched across clients, because with 1,000 clients each holds a few test examples, which fill a
small share of its one batch (every batch has the run's one evaluation shape), and most clients
share one model (every client that never trained holds the store's initial part). For each model
that several clients share, the real content of their batches (real rows; a packed batch's used
stream and attention rows) is packed into batches of the very shapes the clients' own batches have,
run by the program `evaluate_client` runs. Why those shapes: the model computes row by row (a
token's dense layers, an attention row, a pooled example), so the same program on the same shapes
computes each row bit for bit as in the client's own batch, and predictions, scores included, are
exactly `evaluate_client`'s (tests/test_evaluation.py). Other shapes change XLA:CPU's rounding
(measured here: `vmap` over stacked local parts moves MiniLM's logits by ~3e-7, a stream of 4,096
tokens or more takes another matmul path) and buy nothing on a CPU, where the time is the model's
arithmetic per token (a longer stream runs no faster per token), so clients with a local part of
their own are scored one model at a time. Clients are taken in groups to bound memory (`GROUP`).

`evaluate_pooled` scores a single model on the union of the clients' test data (FedNLP's figure
for a global model).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fedjax_split.data.batch import Batch, PackedBatch, apply_batch
from fedjax_split.fed.roles import merge_params
from fedjax_split.tasks.objectives import IGNORE

Apply = Callable[..., jax.Array]
# clients evaluated together by `evaluate_personalised`: enough that the clients sharing a model
# fill its batches (K=1000 packs as densely with 16 as with all 1,000), few enough that a group of
# clients with their own local parts (BERT-base at c=6: 170 MB each) fits in memory
GROUP = 16


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
    return _collect(batches, [predict(params, batch.model_inputs()) for batch in batches])


def _collect(batches: Sequence[Batch], predicted: Sequence[Any]) -> ClientPredictions:
    """A client's real rows: its batches' predictions [S, ...] (one array per batch) with their
    labels and pool indices, padding rows and padded steps dropped."""
    parts: dict[str, list[np.ndarray]] = {"predictions": [], "labels": [], "example_index": []}
    for batch, out in zip(batches, predicted, strict=True):
        real = (np.asarray(batch.example_mask) > 0) & np.asarray(batch.step_mask)[..., None]
        predictions, labels = np.asarray(out), np.asarray(batch.labels)
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
    load = lambda k: jax.tree.map(lambda x: x[k], local_params)  # noqa: E731
    return evaluate_personalised(apply, global_params, load, batches, range(len(batches)),
                                 objective)  # fmt: skip


class _Unit(NamedTuple):
    """The real content of step `step` of batch `batch` of the client at position `client`:
    padded, its real rows; packed, the examples it holds (batch slots) and the prefixes of the
    stream (`tokens`) and of the attention rows (`rows`) they occupy."""

    client: int
    batch: int
    step: int
    examples: np.ndarray
    tokens: int = 0
    rows: int = 0


def _units(client: int, j: int, batch: Batch) -> list[_Unit]:
    """The real content of each real step of a client's batch j (nothing from padded steps)."""
    steps = np.asarray(batch.step_mask)
    real = (np.asarray(batch.example_mask) > 0) & steps[..., None]
    units = []
    for s in np.flatnonzero(steps):
        if not batch.packed:
            if real[s].any():
                units.append(_Unit(client, j, int(s), np.flatnonzero(real[s])))
            continue
        slots = np.asarray(batch.attention_mask[s])
        used = slots > 0  # a packed batch's tokens fill the stream and the rows from the start
        examples = np.union1d(np.flatnonzero(real[s]), np.unique(slots[used]) - 1)
        tokens = int(np.asarray(batch.row_tokens[s])[used].max(initial=-1)) + 1
        rows = int(np.flatnonzero(used.any(-1)).max(initial=-1)) + 1
        if examples.size:
            units.append(_Unit(client, j, int(s), examples, tokens, rows))
    return units


def _shape(batch: Batch) -> tuple:
    """What the program that scores a batch depends on: its kind and its inputs' step shapes."""
    inputs = batch.model_inputs()
    found = ((f.name, getattr(inputs, f.name)) for f in dataclasses.fields(inputs))
    return (type(batch), *((n, x.shape[1:], np.dtype(x.dtype).str) for n, x in found
                           if x is not None))  # fmt: skip


class _Bin:
    """Units of several clients of one model in one batch [1, ...] of their batches' very shape
    (`template`'s); what surrounds them is padding that no real row reads, as in their own."""

    def __init__(self, template: Batch) -> None:
        inputs = template.model_inputs()
        self.kind = type(template)
        self.arrays = {f.name: np.zeros((1, *x.shape[1:]), x.dtype)
                       for f in dataclasses.fields(inputs)
                       if (x := getattr(inputs, f.name)) is not None}  # fmt: skip
        ids = self.arrays["input_ids"]
        if not template.packed:  # padding rows attend to position 0 (no empty softmax row)
            self.arrays["attention_mask"][..., 0] = 1
        labels = np.shape(template.labels)
        self.per_token = template.packed and labels == np.shape(template.input_ids)
        rows = self.arrays["attention_mask"].shape[1] if template.packed else 0
        width = self.arrays["cls_index"].shape[1] if template.packed else ids.shape[1]
        self.room = (width, ids.shape[1] if template.packed else 0, rows)
        self.used = (0, 0, 0)  # examples, stream tokens, attention rows
        self.placed: list[tuple[_Unit, int, int]] = []  # unit, its first example, first token

    def fits(self, unit: _Unit) -> bool:
        need = (unit.examples.size, unit.tokens, unit.rows)
        return all(u + n <= r for u, n, r in zip(self.used, need, self.room, strict=True))

    def add(self, unit: _Unit, batch: Batch) -> None:
        (e0, t0, r0), a, s, n = self.used, self.arrays, unit.step, unit.examples.size
        if not batch.packed:
            for name in ("input_ids", "attention_mask", "token_type_ids"):
                a[name][0, e0 : e0 + n] = np.asarray(getattr(batch, name))[s, unit.examples]
        else:
            t, r, width = unit.tokens, unit.rows, a["attention_mask"].shape[-1]
            for name in ("input_ids", "token_type_ids", "position_ids"):
                a[name][0, t0 : t0 + t] = np.asarray(getattr(batch, name))[s, :t]
            a["token_slots"][0, t0 : t0 + t] = np.asarray(batch.token_slots)[s, :t] + r0 * width
            a["row_tokens"][0, r0 : r0 + r] = np.asarray(batch.row_tokens)[s, :r] + t0
            # each example's slots carry its new batch slot + 1 (attention compares them)
            number = np.zeros(np.shape(batch.cls_index)[-1] + 1, a["attention_mask"].dtype)
            number[unit.examples + 1] = np.arange(e0, e0 + n) + 1
            a["attention_mask"][0, r0 : r0 + r] = number[np.asarray(batch.attention_mask)[s, :r]]
            a["cls_index"][0, e0 : e0 + n] = np.asarray(batch.cls_index)[s, unit.examples] + t0
        self.placed.append((unit, e0, t0))
        self.used = (e0 + n, t0 + unit.tokens, r0 + unit.rows)

    def batch(self) -> Batch:
        return self.kind(**self.arrays)

    def scatter(self, out: np.ndarray, predicted: dict[int, list[Any]], batches: Any) -> None:
        """The bin's predictions [1, ...] back into each unit's place in its own batch's."""
        for unit, e0, t0 in self.placed:
            own = predicted[unit.client]
            if own[unit.batch] is None:
                steps = np.shape(batches[unit.client][unit.batch].step_mask)[0]
                own[unit.batch] = np.zeros((steps, *out.shape[1:]), out.dtype)
            if self.per_token:  # the stream: the unit's tokens, in their order
                own[unit.batch][unit.step, : unit.tokens] = out[0, t0 : t0 + unit.tokens]
            else:
                own[unit.batch][unit.step, unit.examples] = out[0, e0 : e0 + unit.examples.size]


def _score_model(predict: Callable, params: Any, own: dict[int, Sequence[Batch]]
                 ) -> dict[int, ClientPredictions]:  # fmt: skip
    """Clients of one model (position -> test batches): their units packed into bins of their
    batches' shapes, first fit among the last few open bins of a shape. A client with a batch
    that holds nothing real (a padded step only), or of another kind than Batch and PackedBatch,
    is scored batch by batch, as `evaluate_client` scores it."""
    bins: dict[tuple, list[_Bin]] = {}
    alone = []
    for pos, batches in own.items():
        units = [_units(pos, j, b) for j, b in enumerate(batches)]
        if not all(units) or any(type(b) not in (Batch, PackedBatch) for b in batches):
            alone.append(pos)
            continue
        for b, of_batch in zip(batches, units, strict=True):
            open_bins = bins.setdefault(_shape(b), [])
            for unit in of_batch:
                target = next((x for x in open_bins[-4:] if x.fits(unit)), None)
                if target is None:
                    open_bins.append(target := _Bin(b))
                target.add(unit, b)
    # all enqueued before the first is read: the device runs while the host scatters
    outs = [(x, predict(params, x.batch())) for of_shape in bins.values() for x in of_shape]
    predicted: dict[int, list[Any]] = {pos: [None] * len(own[pos]) for pos in own}
    for x, out in outs:
        x.scatter(np.asarray(out), predicted, own)
    for pos in alone:
        predicted[pos] = [predict(params, b.model_inputs()) for b in own[pos]]
    return {pos: _collect(own[pos], predicted[pos]) for pos in own}


def evaluate_personalised(
    apply: Apply,
    global_params: Any,
    load_local: Callable[[int], Any],
    batches: Sequence[Sequence[Batch]],
    ids: Sequence[int],
    objective: Any,
    *,
    group: int = GROUP,
) -> list[ClientPredictions]:
    """Each client's personalised model [global_params, load_local(i)] on its own test batches
    `batches[i]`, for i in `ids`; one result per id, in order, exactly `evaluate_client`'s.

    `global_params`: the global part merged with the frozen one, in the compute dtype;
    `load_local(i)`: client i's local part ({} when nothing is local). Clients are taken `group`
    at a time (memory: one group's local parts, and the merged model of each part the previous
    group shared): their parts loaded, the clients whose part is the same object (or empty)
    scored together by one merged model (see the module docstring); a merged model that several
    clients of a group share is kept for the next group. A client without test batches is not
    loaded.
    """
    if group < 1:
        raise ValueError(f"group must be at least 1, got {group}")
    predict = _predict_fn(apply, objective)
    results: dict[int, ClientPredictions] = {}
    kept: dict[int | None, tuple[Any, Any]] = {}  # id(part) -> (part, merged): the part held
    for start in range(0, len(ids), group):
        models: dict[int | None, tuple[Any, dict[int, Sequence[Batch]]]] = {}
        for pos in range(start, min(start + group, len(ids))):
            own = batches[ids[pos]]
            if not own:
                results[pos] = _collect([], [])
                continue
            part = load_local(ids[pos])
            key = id(part) if jax.tree.leaves(part) else None
            models.setdefault(key, (part, {}))[1][pos] = own
        carried = {}
        for key, (part, own) in models.items():
            merged = kept[key][1] if key in kept else merge_params(global_params, part)
            merged = jax.device_put(merged)  # once per model, not once per batch
            if key in kept or len(own) > 1:
                carried[key] = (part, merged)
            results.update(_score_model(predict, merged, own))
        kept = carried
    return [results[pos] for pos in range(len(ids))]


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
    per_client = evaluate_personalised(apply, params, lambda i: {}, batches, range(len(batches)),
                                       objective)  # fmt: skip
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
