"""A FedBFPT round on a tiny BERT: only layer l and the MLM head change on the server, only they
are sent (4 bytes x their parameter count per client), the server takes the weighted mean of the
uploads; the held-out evaluation against a plain log-softmax."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fedcore_helpers import tiny_config

from fedjax_split.data.text import mlm_batching
from fedjax_split.data.text.masking import MaskingSpec
from fedjax_split.data.text.text_corpora import Sequences
from fedjax_split.fed import algorithms, layerwise
from fedjax_split.fed.client import default_client_optimizer
from fedjax_split.fed.roles import flatten_paths
from fedjax_split.fed.server import init_server_state
from fedjax_split.fed.strategy import Sampling, Strategy
from fedjax_split.models.bert import init_params, make_apply
from fedjax_split.sim import pretrain_rounds
from fedjax_split.tasks.objectives import IGNORE

H, INTER, V, L = 16, 32, 50, 4  # tiny_config's sizes, 4 layers
SPEC = MaskingSpec(mask_id=4, vocab_size=V, special_ids=(0, 1, 2, 3, 4))


@pytest.fixture(scope="module")
def setup():
    config = dataclasses.replace(tiny_config(), num_hidden_layers=L, head="mlm")
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    clients = []
    for n in (5, 9, 3):  # sequences per client
        ids = rng.integers(5, V, (n, 12)).astype(np.int32)
        ids[:, 0], ids[:, -1] = 2, 3
        clients.append(Sequences(ids, np.full(n, 12, np.int32)))
    segments = [
        mlm_batching.train_segments(
            s, batch_size=4, epochs=1, steps_per_segment=2, masking=SPEC, seed=[0, 1, c]
        )  # fmt: skip
        for c, s in enumerate(clients)
    ]
    trainer = pretrain_rounds.Trainer(
        config, default_client_optimizer(1e-2), algorithms.server_optimizer("fedavg")
    )
    return config, params, segments, trainer


def test_one_round_moves_and_sends_only_layer_l_and_the_head(setup) -> None:
    config, params, segments, trainer = setup
    server_opt = algorithms.server_optimizer("fedavg")
    state = init_server_state(params, server_opt, "float32")
    before = {p: np.asarray(x) for p, x in flatten_paths(state.master).items()}
    plan = layerwise.fedbfpt_plan(params, layer=1, round_=1, clients=[0, 1, 2], seed=0,
                                  small_layers=3)  # fmt: skip
    weights = [5.0, 9.0, 3.0]
    # each client on its own, as the round runs them, to average by hand
    received = state.global_params
    uploads = []
    for c, layers, segs in zip([0, 1, 2], plan.layers, segments, strict=True):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 1), c)
        up, _ = pretrain_rounds.client_update(trainer, received, layers, plan.trained, segs, key, c)
        assert set(flatten_paths(up)) == plan.trained  # only layer 1 and the head are sent
        uploads.append({p: np.asarray(x) for p, x in flatten_paths(up).items()})
    seen: list = []  # each client's end: clients, steps and sequences so far
    strategy = Strategy(Sampling(3, None, seed=0), lambda r: trainer.server_spec(plan.trained),
                        layers_for=lambda r, sampled: plan.layers)  # fmt: skip
    round_plan = strategy.plan(1, state, None)
    assert round_plan.clients.tolist() == [0, 1, 2] and round_plan.layers == plan.layers
    outcome = pretrain_rounds.run_round(
        trainer, strategy, state, round_plan, segments, weights, seed=0, on_progress=seen.append
    )  # fmt: skip
    sequences = [int(sum(np.asarray(s.example_mask).sum() for s in segs)) for segs in segments]
    assert [tuple(p) for p in seen] == [
        (k, 3, [2, 5, 6][k - 1], 6, sum(sequences[:k])) for k in (1, 2, 3)
    ]
    after = {p: np.asarray(x) for p, x in flatten_paths(outcome.state.master).items()}
    trained = {
        p for p in before if p.startswith(("encoder/layer_1/", "mlm/transform/", "mlm/bias"))
    }
    assert trained == plan.trained
    for p in before:
        if p in trained:
            assert not np.array_equal(after[p], before[p]), p
            mean = sum(w * u[p] for w, u in zip(weights, uploads, strict=True)) / sum(weights)
            np.testing.assert_allclose(after[p], mean, rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(after[p], before[p])  # exactly put, word table included
    # bytes: fp32, 4 x (one layer + the head's transform and bias), per client
    layer = 4 * (H * H + H) + 2 * H + (H * INTER + INTER) + (INTER * H + H) + 2 * H
    head = (H * H + H) + 2 * H + V
    assert [r.bytes_up for r in outcome.clients] == [4 * (layer + head)] * 3
    assert outcome.bytes_up == 3 * 4 * (layer + head)
    assert [r.layers for r in outcome.clients] == list(plan.layers)
    assert outcome.rejected == []
    assert [r.steps for r in outcome.clients] == [2, 3, 1] and all(
        r.flops > 0 for r in outcome.clients
    )


def test_a_non_finite_upload_is_left_out_and_named(setup, monkeypatch) -> None:
    """The server's step is the strategy's: an upload that is not finite (a client that diverged)
    is left out of the mean, which is the others' weighted mean, and the round names it."""
    config, params, segments, trainer = setup
    state = init_server_state(params, algorithms.server_optimizer("fedavg"), "float32")
    plan = layerwise.full_plan(params, clients=[0, 1, 2], depth=L)
    strategy = Strategy(Sampling(3, None, seed=0), lambda r: trainer.server_spec(plan.trained))
    real_update = pretrain_rounds.client_update
    uploads = {}

    def update(*args, **kwargs):
        new, report = real_update(*args, **kwargs)
        if report.client == 1:
            new = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), new)
        uploads[report.client] = {p: np.asarray(x) for p, x in flatten_paths(new).items()}
        return new, report

    monkeypatch.setattr(pretrain_rounds, "client_update", update)
    weights = [5.0, 9.0, 3.0]
    outcome = pretrain_rounds.run_round(trainer, strategy, state, strategy.plan(1, state, None),
                                        segments, weights, seed=0)  # fmt: skip
    assert outcome.rejected == [1]
    after = flatten_paths(outcome.state.master)
    for p in plan.trained:
        mean = (5.0 * uploads[0][p] + 3.0 * uploads[2][p]) / 8.0
        np.testing.assert_allclose(np.asarray(after[p]), mean, rtol=1e-6, atol=1e-7)


def test_held_out_loss_and_accuracy_by_hand(setup) -> None:
    config, params, segments, _ = setup
    batches = [jax.tree.map(lambda x: x[0], seg) for seg in segments[1]]  # [B, T] batches
    got = pretrain_rounds.evaluate(config, params, batches)
    apply = jax.jit(make_apply(config), static_argnames="train")
    logits = np.concatenate(
        [np.asarray(apply(params, b.input_ids, b.attention_mask, train=False))
         for b in batches]
    )  # fmt: skip
    positions = np.concatenate([b.positions for b in batches])
    labels = np.concatenate([b.labels for b in batches])
    real = np.concatenate([b.example_mask for b in batches])[:, None] > 0
    at = np.take_along_axis(logits, positions[..., None], axis=1)
    logp = at - np.log(np.exp(at - at.max(-1, keepdims=True)).sum(-1, keepdims=True))
    logp -= at.max(-1, keepdims=True)
    used = (labels != IGNORE) & real
    nll = -np.take_along_axis(logp, np.where(used, labels, 0)[..., None], -1)[..., 0]
    assert got["predicted_tokens"] == used.sum() > 0
    assert got["mlm_loss"] == pytest.approx(nll[used].mean(), rel=1e-5)
    assert got["mlm_accuracy"] == pytest.approx((at.argmax(-1) == labels)[used].mean())
    assert jnp.isfinite(got["mlm_loss"])


def test_unigram_level_by_hand() -> None:
    """Targets 5, 5, 7, 9 (padding rows and unused slots left out): the most frequent is right
    2 times of 4, and the targets' entropy is -(1/2 ln 1/2 + 2 * 1/4 ln 1/4) = 1.5 ln 2."""
    from fedjax_split.data.text.masking import MaskedBatch

    def batch(labels: list[list[int]], rows: list[int]) -> MaskedBatch:
        labels = np.asarray(labels, np.int32)
        b = labels.shape[0]
        return MaskedBatch(input_ids=np.zeros((b, 4), np.int32),
                           attention_mask=np.ones((b, 4), np.int32),
                           token_type_ids=np.zeros((b, 4), np.int32), labels=labels,
                           example_mask=np.asarray(rows, np.float32),
                           positions=np.zeros_like(labels))  # fmt: skip

    got = pretrain_rounds.unigram_level([
        batch([[5, 7], [9, IGNORE]], [1, 1]),
        batch([[5, IGNORE], [5, 5]], [1, 0]),  # the second row is padding
    ])  # fmt: skip
    assert got["predicted_tokens"] == 4
    assert got["unigram_accuracy"] == 0.5
    assert got["unigram_loss"] == pytest.approx(1.5 * np.log(2), rel=1e-12)
    assert pretrain_rounds.unigram_level([])["predicted_tokens"] == 0
