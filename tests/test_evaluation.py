"""Personalised evaluation vs each client's merged model applied one client at a time."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fedcore_helpers import make_segments, per_client, tiny_config, tiny_model

from fedjax_split.fed.roles import merge_params, split_params
from fedjax_split.models.bert import init_params, make_apply
from fedjax_split.sim.evaluation import (
    ClientPredictions,
    client_metrics,
    evaluate_clients,
    evaluate_pooled,
)
from fedjax_split.tasks.objectives import (
    CLASSIFICATION,
    IGNORE,
    REGRESSION,
    TOKEN_CLASSIFICATION,
    Classification,
    TokenClassification,
)

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


def _test_splits(rng, sizes, *, packing, objective, batch_size=8):
    """Each client's test batches as a run builds them (`client_eval_batches`, examples of random
    lengths, so batches of several shapes); a client of size 0 has none."""
    from fedjax_split.data.batching import Batching, client_eval_batches
    from fedjax_split.data.tokenization import Tokenized

    n = sum(sizes)
    lengths = rng.integers(2, 15, n)
    tags = [np.where(np.arange(m) % 4 == 0, IGNORE, rng.integers(0, 3, m)).astype(np.int32)
            for m in lengths] if objective.per_token else None  # fmt: skip
    ids = [rng.integers(1, 50, m).astype(np.int32) for m in lengths]
    tok = Tokenized(ids, [np.zeros(m, np.int32) for m in lengths], lengths.astype(np.int32), tags)
    labels = (rng.uniform(0, 5, n).astype(np.float32) if objective is REGRESSION
              else rng.integers(0, 3, n))  # fmt: skip
    how = Batching(batch_size, objective=objective, packing=packing, row_width=16)
    bounds = np.cumsum([0, *sizes])
    return [client_eval_batches(tok, np.arange(a, b), labels, how) if b > a else []
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)]  # fmt: skip


def _spy_bins(monkeypatch):
    """How many clients' units each dispatched bin holds."""
    from fedjax_split.sim import evaluation

    held, original = [], evaluation._Bin.batch

    def batch(self):
        held.append(len({unit.client for unit, _, _ in self.placed}))
        return original(self)

    monkeypatch.setattr(evaluation._Bin, "batch", batch)
    return held


class _LogitSum(Classification):
    """A class task whose predictions are a float of every logit (the sum weighted by class
    number), so that comparing predictions compares the logits' bits, not only their argmax."""

    def predict(self, logits):
        return jnp.sum(logits * jnp.arange(1, logits.shape[-1] + 1, dtype=logits.dtype), -1)


class _TokenLogitSum(_LogitSum, TokenClassification):
    """The same per token."""


OBJECTIVES = [CLASSIFICATION, REGRESSION, TOKEN_CLASSIFICATION, _LogitSum(), _TokenLogitSum()]


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: type(o).__name__)
def test_batched_evaluation_is_one_client_at_a_time_bit_for_bit(
    objective, packing, monkeypatch
) -> None:
    """Clients of different test sizes (one with none), four sharing one local part (the same
    object, as a client store returns to clients that never trained) and three with their own,
    a subset of ids out of order, group sizes that do not divide it: every client's predictions
    (scores included), labels and pool indices are exactly those of its own model scoring its own
    batches alone; several clients' rows share a batch."""
    from fedjax_split.sim.evaluation import evaluate_client, evaluate_personalised

    num_labels = 1 if objective is REGRESSION else 3
    config = dataclasses.replace(tiny_config(num_labels=num_labels),
                                 head="token" if objective.per_token else "sequence")  # fmt: skip
    rng = np.random.default_rng(11)
    noise = lambda x, scale: x + rng.normal(0, scale, x.shape).astype(np.float32)  # noqa: E731
    # weights far from init's N(0, 0.02), so that predictions follow the input and a row scored
    # with another row's attention or tokens would come out different
    params = jax.tree.map(lambda x: noise(x, 0.5), init_params(config, jax.random.key(7)))
    apply = make_apply(config)
    g, shared = split_params(params, critical_layer=1)
    own = {i: jax.tree.map(lambda x: noise(x, 0.3), shared) for i in (1, 4, 6)}
    load = lambda i: own.get(i, shared)  # noqa: E731
    batches = _test_splits(rng, [3, 1, 0, 2, 11, 1, 5, 2], packing=packing, objective=objective)
    ids = [7, 2, 0, 5, 1, 3, 6, 4]
    want = [evaluate_client(apply, merge_params(g, load(i)), batches[i], objective) for i in ids]
    held = _spy_bins(monkeypatch)
    for group in (3, 5, 16):
        got = evaluate_personalised(apply, g, load, batches, ids, objective, group=group)
        assert len(got) == len(ids)
        # every field bit for bit, dtypes and shapes included (None only where want has None)
        chex.assert_trees_all_equal(got, want, strict=True)
    assert len(want[1].labels) == 0 and max(held) > 1  # client 2 has no test examples
    assert len(np.unique(np.concatenate([w.predictions.ravel() for w in want]))) > 1
    # guard: client 4's own model and the shared one disagree on client 4's rows, so scoring a
    # client with another's local part would be caught
    other = evaluate_client(apply, merge_params(g, shared), batches[4], objective)
    assert not np.array_equal(other.predictions, want[ids.index(4)].predictions)


def test_clients_without_test_examples_are_not_loaded_and_a_shared_part_is_merged_once(
    monkeypatch,
) -> None:
    """load_local runs once per client with test batches; the merged model of a part that several
    clients of a group share is built once and kept for the next groups, a client's own once."""
    from fedjax_split.sim import evaluation

    apply, params = tiny_model(num_labels=3)
    g, shared = split_params(params, critical_layer=1)
    batches = _test_splits(np.random.default_rng(3), [2, 0, 1, 3, 0, 2, 1],
                           packing=True, objective=CLASSIFICATION)  # fmt: skip
    loaded, merges = [], []
    mine = jax.tree.map(lambda x: x + 1.0, shared)
    load = lambda i: loaded.append(i) or (mine if i == 3 else shared)  # noqa: E731
    real_merge = evaluation.merge_params
    monkeypatch.setattr(
        evaluation, "merge_params", lambda *a: merges.append(a[1]) or real_merge(*a)
    )
    got = evaluation.evaluate_personalised(
        apply, g, load, batches, range(7), CLASSIFICATION, group=3
    )
    assert loaded == [0, 2, 3, 5, 6]
    assert [m is mine for m in merges] == [False, True]
    assert [len(r.labels) for r in got] == [2, 0, 1, 3, 0, 2, 1]
    with pytest.raises(ValueError, match="group"):
        evaluation.evaluate_personalised(apply, g, load, batches, [0], CLASSIFICATION, group=0)
