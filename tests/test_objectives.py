"""tasks.objectives: losses and predictions against values computed by hand."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_split.tasks.objectives import (
    CLASSIFICATION,
    IGNORE,
    OBJECTIVES,
    REGRESSION,
    TOKEN_CLASSIFICATION,
)


def _ce(logits: list[float], label: int) -> float:
    """-log softmax(logits)[label], by hand."""
    return math.log(sum(math.exp(v) for v in logits)) - logits[label]


def test_token_loss_counts_labelled_tokens_of_real_rows_only() -> None:
    logits = np.array(
        [
            [[2.0, 0.0, -1.0], [9.0, -9.0, 0.0], [0.5, 1.5, 0.0], [0.0, 0.0, 7.0]],
            [[1.0, 1.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
        ],
        np.float32,
    )
    # row 0: a word's first sub-word (label 1), its second sub-word (IGNORE), a word (label 0),
    # padding (IGNORE); row 1 has labels but is a padding row of the batch (example_mask 0)
    labels = np.array([[1, IGNORE, 0, IGNORE], [2, 0, IGNORE, IGNORE]], np.int32)
    total, count = TOKEN_CLASSIFICATION.loss_sums(
        jnp.asarray(logits), jnp.asarray(labels), jnp.asarray([1.0, 0.0])
    )
    want = _ce([2.0, 0.0, -1.0], 1) + _ce([0.5, 1.5, 0.0], 0)
    assert float(count) == 2.0
    np.testing.assert_allclose(float(total), want, rtol=1e-6)
    # a huge logit at an ignored position changes nothing
    logits[0, 1] = [1e4, -1e4, 0.0]
    again, _ = TOKEN_CLASSIFICATION.loss_sums(
        jnp.asarray(logits), jnp.asarray(labels), jnp.asarray([1.0, 0.0])
    )
    assert float(again) == float(total)


def test_packed_token_loss_reads_the_stream_labels() -> None:
    logits = jnp.asarray([[0.0, 2.0], [1.0, 0.0], [5.0, 5.0]])  # stream [N, C]
    labels = jnp.asarray([1, IGNORE, 0])
    total, count = TOKEN_CLASSIFICATION.loss_sums(logits, labels, jnp.asarray([1.0, 1.0]))
    np.testing.assert_allclose(float(total), _ce([0.0, 2.0], 1) + _ce([5.0, 5.0], 0), rtol=1e-6)
    assert float(count) == 2.0


def test_classification_and_regression_losses_by_hand() -> None:
    logits = jnp.asarray([[1.0, 2.0], [0.0, -1.0], [3.0, 3.0]])
    total, count = CLASSIFICATION.loss_sums(logits, jnp.asarray([1, 0, 0]), jnp.asarray([1, 1, 0]))
    np.testing.assert_allclose(float(total), _ce([1.0, 2.0], 1) + _ce([0.0, -1.0], 0), rtol=1e-6)
    assert float(count) == 2.0
    scores = jnp.asarray([[1.5], [4.0]])
    total, count = REGRESSION.loss_sums(scores, jnp.asarray([1.0, 3.0]), jnp.asarray([1.0, 1.0]))
    assert float(total) == 0.25 + 1.0 and float(count) == 2.0


def test_predictions_and_registry() -> None:
    logits = jnp.asarray([[[0.1, 0.9], [0.8, 0.2]]])
    assert TOKEN_CLASSIFICATION.predict(logits).tolist() == [[1, 0]]
    assert CLASSIFICATION.predict(logits[0]).tolist() == [1, 0]
    assert REGRESSION.predict(jnp.asarray([[2.5], [0.5]])).tolist() == [2.5, 0.5]
    assert REGRESSION.predict(jnp.asarray([[2.5]])).dtype == jnp.float32
    assert OBJECTIVES["token_classification"] is TOKEN_CLASSIFICATION
    assert {o.head for o in OBJECTIVES.values()} == {"sequence", "token", "mlm"}
    assert len({hash(o) for o in OBJECTIVES.values()}) == 4  # hashable: round specs cache on them


def test_masked_lm_loss_is_the_mean_over_predicted_slots() -> None:
    """Logits [B, P, V] at the prediction slots, labels [B, P] with IGNORE in unused slots; a
    padding row's slots never count. Expected values by hand (log-softmax)."""
    from fedjax_split.tasks.objectives import IGNORE, MASKED_LM

    logits = jnp.asarray([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]], [[0.0, 0.0, 5.0], [1.0, 1.0, 1.0]]])
    labels = jnp.asarray([[0, IGNORE], [2, 1]])
    total, count = MASKED_LM.loss_sums(logits, labels, jnp.asarray([1.0, 1.0]))
    nll = lambda row, k: float(jnp.log(jnp.sum(jnp.exp(row))) - row[k])  # noqa: E731
    assert float(count) == 3.0
    assert float(total) == pytest.approx(
        nll(logits[0, 0], 0) + nll(logits[1, 0], 2) + nll(logits[1, 1], 1), rel=1e-6
    )
    total, count = MASKED_LM.loss_sums(logits, labels, jnp.asarray([1.0, 0.0]))
    assert float(count) == 1.0 and float(total) == pytest.approx(nll(logits[0, 0], 0), rel=1e-6)
    assert MASKED_LM.head == "mlm" and MASKED_LM.per_token
