"""Personalised evaluation vs each client's merged model applied one client at a time."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from fedcore_helpers import make_segments, per_client, tiny_config, tiny_model

from fedjax_split.fed.roles import merge_params, split_params
from fedjax_split.models.bert import init_params, make_apply
from fedjax_split.sim.evaluation import (
    ClientPredictions,
    client_metrics,
    evaluate_clients,
    evaluate_pooled,
)
from fedjax_split.tasks.objectives import CLASSIFICATION, IGNORE, REGRESSION, TOKEN_CLASSIFICATION

K = 3


def _own_models(params):
    """Distinct personalised models: the local part differs per client."""
    g, loc = split_params(params, critical_layer=1)
    rng = np.random.default_rng(5)
    locals_k = [
        jax.tree.map(lambda x: x + rng.normal(0, 0.5, x.shape).astype(np.float32), loc)
        for _ in range(K)
    ]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *locals_k)
    return g, locals_k, stacked


def _expected(apply, params, seg, k, regression):
    """Client k's real rows scored one batch at a time (no vmap, no scan)."""
    preds, labels = [], []
    for s in range(seg.input_ids.shape[1]):
        if not seg.step_mask[k, s]:
            continue
        logits = np.asarray(
            apply(
                params,
                seg.input_ids[k, s],
                seg.attention_mask[k, s],
                seg.token_type_ids[k, s],
                train=False,
            )
        )
        out = logits[:, 0] if regression else logits.argmax(-1)
        keep = seg.example_mask[k, s] > 0
        preds.append(out[keep])
        labels.append(seg.labels[k, s][keep])
    return np.concatenate(preds), np.concatenate(labels)


def test_evaluate_clients_personalised_and_masked() -> None:
    apply, params = tiny_model(num_labels=3)
    g, locals_k, stacked = _own_models(params)
    segs = make_segments(np.random.default_rng(0), [3, 1, 2], 3, num_segments=2)
    # make padded rows conspicuous: their labels must never come back
    for i, seg in enumerate(segs):
        seg.labels[seg.example_mask == 0] = 99
        index = np.arange(seg.labels.size, dtype=np.int32).reshape(seg.labels.shape)
        segs[i] = seg.replace(example_index=np.where(seg.example_mask > 0, index + 1000 * i, -1))
    got = evaluate_clients(apply, g, stacked, per_client(segs), CLASSIFICATION)
    assert len(got) == K
    for k in range(K):
        merged = merge_params(g, locals_k[k])
        parts = [_expected(apply, merged, seg, k, False) for seg in segs]
        np.testing.assert_array_equal(got[k].predictions, np.concatenate([p for p, _ in parts]))
        np.testing.assert_array_equal(got[k].labels, np.concatenate([lab for _, lab in parts]))
        assert 99 not in got[k].labels
        want_index = [seg.example_index[k][seg.example_mask[k] > 0] for seg in segs]
        np.testing.assert_array_equal(got[k].example_index, np.concatenate(want_index))
    assert [len(r.labels) for r in got] == [2 * 11, 2 * 3, 2 * 7]
    # guard: the clients' models disagree on client 0's rows, so a mix-up would be caught
    other = _expected(apply, merge_params(g, locals_k[1]), segs[0], 0, False)[0]
    assert not np.array_equal(
        other, _expected(apply, merge_params(g, locals_k[0]), segs[0], 0, False)[0]
    )


def test_regression_and_pooled() -> None:
    apply, params = tiny_model(num_labels=1)
    segs = make_segments(np.random.default_rng(1), [2, 2, 1], 2, num_labels=1)
    pooled = evaluate_pooled(apply, params, per_client(segs), REGRESSION)
    want = [_expected(apply, params, segs[0], k, True) for k in range(K)]
    np.testing.assert_allclose(
        pooled.predictions, np.concatenate([p for p, _ in want]), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_array_equal(pooled.labels, np.concatenate([lab for _, lab in want]))
    assert pooled.predictions.dtype == np.float32


def test_client_metrics_mean_is_over_clients() -> None:
    results = [
        ClientPredictions(np.array([1, 1, 1, 1]), np.array([1, 1, 1, 0])),  # 0.75
        ClientPredictions(np.array([0]), np.array([1])),  # 0.0
        ClientPredictions(np.array([], np.int32), np.array([], np.int32)),  # skipped
    ]
    acc = lambda p, y: {"accuracy": float(np.mean(p == y))}  # noqa: E731
    per_client, mean = client_metrics(results, acc)
    assert per_client == [{"accuracy": 0.75}, {"accuracy": 0.0}]
    assert mean == {"accuracy": 0.375}  # pooled accuracy would be 0.6


def test_token_predictions_of_segments_of_different_lengths() -> None:
    """Per-token predictions come back per row, padded to the longest segment with IGNORE; the
    labels beside them keep IGNORE wherever there is no label."""
    config = dataclasses.replace(tiny_config(num_labels=4), head="token")
    apply, params = make_apply(config), init_params(config, jax.random.key(0))
    rng = np.random.default_rng(2)
    segs = []
    for length in (6, 9):
        seg = make_segments(rng, [2, 1, 2], 2, length=length)[0]
        labels = rng.integers(0, 4, size=seg.input_ids.shape).astype(np.int32)
        segs.append(seg.replace(labels=np.where(seg.attention_mask > 0, labels, IGNORE)))
    got = evaluate_clients(apply, params, {}, per_client(segs), TOKEN_CLASSIFICATION)
    for k, res in enumerate(got):
        assert res.predictions.shape == res.labels.shape and res.predictions.shape[1] == 9
        rows = []
        for seg in segs:
            for s in range(seg.input_ids.shape[1]):
                logits = np.asarray(
                    apply(
                        params,
                        seg.input_ids[k, s],
                        seg.attention_mask[k, s],
                        seg.token_type_ids[k, s],
                        train=False,
                    )
                )
                for b in np.nonzero(seg.example_mask[k, s] * seg.step_mask[k, s])[0]:
                    pad = 9 - logits.shape[1]
                    rows.append(
                        (
                            np.pad(logits[b].argmax(-1), (0, pad), constant_values=IGNORE),
                            np.pad(seg.labels[k, s, b], (0, pad), constant_values=IGNORE),
                        )
                    )
        np.testing.assert_array_equal(res.predictions, np.stack([p for p, _ in rows]))
        np.testing.assert_array_equal(res.labels, np.stack([lab for _, lab in rows]))


def test_packed_token_predictions_come_back_per_example_like_padded_ones() -> None:
    """A packed batch's per-token predictions lie on its token stream; evaluation hands them back
    as per-example rows, equal to the padded batch's (no dropout in evaluation)."""
    from fedjax_split.data.batching import Batching, client_eval_batches
    from fedjax_split.data.tokenization import Tokenized
    from fedjax_split.sim.evaluation import evaluate_client

    config = dataclasses.replace(tiny_config(num_labels=4), head="token")
    apply, params = make_apply(config), init_params(config, jax.random.key(1))
    rng = np.random.default_rng(3)
    lengths = rng.integers(2, 12, 9)
    tok = Tokenized(
        [rng.integers(1, 50, n).astype(np.int32) for n in lengths],
        [np.zeros(n, np.int32) for n in lengths],
        lengths.astype(np.int32),
        [np.where(np.arange(n) % 3 == 0, IGNORE, rng.integers(0, 4, n)).astype(np.int32)
         for n in lengths],
    )  # fmt: skip
    kw = dict(objective=TOKEN_CLASSIFICATION, row_width=16)
    padded = client_eval_batches(tok, np.arange(9), np.zeros(9, int),
                                 Batching(4, packing=False, **kw))  # fmt: skip
    packed = client_eval_batches(tok, np.arange(9), np.zeros(9, int),
                                 Batching(4, packing=True, **kw))  # fmt: skip
    assert all(b.packed for b in packed) and not any(b.packed for b in padded)
    a = evaluate_client(apply, params, padded, TOKEN_CLASSIFICATION)
    b = evaluate_client(apply, params, packed, TOKEN_CLASSIFICATION)
    # padded batches come sorted by length, packed ones in order: compare example by example
    a = ClientPredictions(*(x[np.argsort(a.example_index)] for x in a))
    b = ClientPredictions(*(x[np.argsort(b.example_index)] for x in b))
    np.testing.assert_array_equal(a.example_index, np.arange(9))
    np.testing.assert_array_equal(b.example_index, np.arange(9))
    width = min(a.labels.shape[1], b.labels.shape[1])
    np.testing.assert_array_equal(a.labels[:, :width], b.labels[:, :width])
    labelled = a.labels[:, :width] != IGNORE
    np.testing.assert_array_equal(a.predictions[:, :width][labelled],
                                  b.predictions[:, :width][labelled])  # fmt: skip
    assert labelled.sum() == sum(int((x != IGNORE).sum()) for x in tok.labels)
