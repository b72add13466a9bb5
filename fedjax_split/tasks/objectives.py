"""Task objectives: what a task asks of the model (its head), its loss, and its predictions.

The federated core trains whatever objective a task names and never asks which kind it is: the
client update calls `loss_sums`, evaluation calls `predict`, batching reads `label_dtype`.
Objectives are frozen dataclasses, hence hashable: a round's compiled programs are cached per
objective like any other part of its spec.

- classification: one label per example; cross-entropy on the pooled [CLS] head.
- regression: one score per example (STS-B); squared error on logits[:, 0].
- token classification: one label per token (NER, BIO tags); cross-entropy on every token whose
  label is not IGNORE (-100: sub-words after a word's first, special tokens, padding), averaged
  over those tokens as transformers' BertForTokenClassification does.
- masked language modelling: the original token at each position masking selected
  (`data.text.masking`); cross-entropy over the vocabulary, averaged over the predicted tokens as
  transformers' BertForMaskedLM does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

IGNORE = -100
"""Token label that takes no part in the loss or the metrics (transformers' ignore_index)."""


@dataclasses.dataclass(frozen=True)
class Classification:
    """One class per example, from the pooled [CLS] representation."""

    name: str = "classification"
    head: str = "sequence"  # models.bert_config.BertConfig.head
    label_dtype: type = np.int32
    per_token: bool = False

    def unit_losses(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        """Loss of each example [B] (logits [B, C])."""
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), labels.astype(jnp.int32)
        )

    def loss_sums(
        self, logits: jax.Array, labels: jax.Array, example_mask: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(sum of the losses over real examples, their number): the loss is their ratio."""
        mask = example_mask.astype(jnp.float32)
        return jnp.sum(self.unit_losses(logits, labels) * mask), jnp.sum(mask)

    def predict(self, logits: jax.Array) -> jax.Array:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Regression(Classification):
    """One score per example (STS-B), the head's first output."""

    name: str = "regression"
    label_dtype: type = np.float32

    def unit_losses(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        return jnp.square(logits.astype(jnp.float32)[:, 0] - labels.astype(jnp.float32))

    def predict(self, logits: jax.Array) -> jax.Array:
        return logits[:, 0].astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class TokenClassification(Classification):
    """One class per token (logits [B, T, C], labels [B, T]; packed: [N, C] and [N])."""

    name: str = "token_classification"
    head: str = "token"
    per_token: bool = True

    def loss_sums(
        self, logits: jax.Array, labels: jax.Array, example_mask: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(sum of the losses over labelled tokens of real examples, their number). Padding rows
        carry IGNORE labels already; the row mask is applied too, so that a row's labels never
        count when its example is masked out."""
        labels = labels.astype(jnp.int32)
        labelled = labels != IGNORE
        if example_mask.ndim == labels.ndim - 1:  # padded [B] rows of [B, T] tokens
            labelled &= example_mask[..., None] > 0
        losses = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), jnp.where(labelled, labels, 0)
        )
        weight = labelled.astype(jnp.float32)
        return jnp.sum(losses * weight), jnp.sum(weight)


@dataclasses.dataclass(frozen=True)
class MaskedLM(TokenClassification):
    """The original token at each prediction slot: logits [B, P, vocab] from the MLM head at the
    positions a `data.text.masking.MaskedBatch` names, labels [B, P] (IGNORE in unused slots).

    Why slots rather than [B, T] labels: the decoder's vocabulary matmul costs as much per token
    as a whole MiniLM layer stack, and only about 15% of the tokens are predicted; the loss is the
    same mean over predicted tokens as transformers' over [B, T] labels with IGNORE elsewhere."""

    name: str = "masked_lm"
    head: str = "mlm"


CLASSIFICATION = Classification()
REGRESSION = Regression()
TOKEN_CLASSIFICATION = TokenClassification()
MASKED_LM = MaskedLM()
OBJECTIVES = {o.name: o for o in (CLASSIFICATION, REGRESSION, TOKEN_CLASSIFICATION, MASKED_LM)}
