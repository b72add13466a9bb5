"""Dynamic masking for masked-language modelling: which tokens a step predicts, and what the
model sees in their place.

BERT's recipe (Devlin et al. 2019; Google's create_pretraining_data.py): in each sequence, 15% of
the tokens that are not special ([CLS], [SEP], [PAD], [UNK], [MASK]) are selected, exactly
round(0.15 n) of the n candidates and at least one, without replacement; a selected token is
replaced by [MASK] with probability 0.8, by a token drawn uniformly from the vocabulary with
probability 0.1, and left as it is with probability 0.1; the model is asked the original token at
every selected position. transformers' DataCollatorForLanguageModeling selects each token by an
independent Bernoulli(0.15) draw instead: the same rate in expectation. We fix the count because
it bounds the predictions per sequence by ceil(0.15 T), so a batch's prediction slots have a
static shape [B, P] (`prediction_slots`) and the decoder's vocabulary matmul runs on those P
tokens only (see `objectives.MaskedLM`).

Masks are drawn afresh every round (dynamic masking, as RoBERTa and transformers' collator do),
from a `np.random.Generator` the caller seeds with explicit numbers such as
`default_rng([seed, round, client, purpose])`: a pure function of them, never numpy's global
generator.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from flax import struct

from fedjax_split.data.batch import Array, Batch
from fedjax_split.tasks.objectives import IGNORE


@dataclasses.dataclass(frozen=True)
class MaskingSpec:
    """What masking needs to know of the tokenizer, and the rates (BERT's by default)."""

    mask_id: int
    vocab_size: int
    special_ids: tuple[int, ...]
    rate: float = 0.15
    mask_share: float = 0.8
    random_share: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"masking rate must be in (0, 1], got {self.rate}")
        if self.mask_share < 0 or self.random_share < 0 or self.mask_share + self.random_share > 1:
            raise ValueError("mask and random shares must be >= 0 and sum to at most 1")


def spec_from_tokenizer(tokenizer: Any, rate: float = 0.15) -> MaskingSpec:
    """The spec of a transformers tokenizer: its [MASK] id, vocabulary size, special ids."""
    if tokenizer.mask_token_id is None:
        raise ValueError("the tokenizer has no [MASK] token; MLM needs one")
    return MaskingSpec(
        mask_id=int(tokenizer.mask_token_id),
        vocab_size=len(tokenizer),
        special_ids=tuple(sorted(int(i) for i in tokenizer.all_special_ids)),
        rate=rate,
    )


def prediction_slots(width: int, rate: float) -> int:
    """P, the prediction slots of a row of `width` tokens: at least the selected count."""
    return max(1, math.ceil(rate * width))


def selected_count(candidates: np.ndarray, rate: float) -> np.ndarray:
    """round(rate * n), at least 1 where n > 0 (halves round up, not to even)."""
    n = np.asarray(candidates)
    k = np.floor(rate * n + 0.5).astype(np.int64)
    return np.where(n > 0, np.maximum(k, 1), 0)


def mask_tokens(
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    spec: MaskingSpec,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masks rows of tokens [..., T]: returns (the model's input ids [..., T], positions [..., P]
    of the predicted tokens, labels [..., P]: their original ids, IGNORE in unused slots, whose
    position is 0). Candidates are real tokens (attention_mask > 0) that are not special."""
    ids = np.asarray(input_ids)
    width = ids.shape[-1]
    slots = prediction_slots(width, spec.rate)
    candidate = (np.asarray(attention_mask) > 0) & ~np.isin(ids, spec.special_ids)
    k = selected_count(candidate.sum(-1), spec.rate)
    # a uniform random subset of k candidates: the k smallest of uniform keys (others last)
    keys = np.where(candidate, rng.random(ids.shape), 2.0)
    order = np.argsort(keys, axis=-1, kind="stable")[..., :slots]
    used = np.arange(slots) < k[..., None]
    positions = np.where(used, order, 0).astype(np.int32)
    original = np.take_along_axis(ids, positions.astype(np.int64), axis=-1)
    labels = np.where(used, original, IGNORE).astype(np.int32)
    draw = rng.random(positions.shape)
    random_ids = rng.integers(0, spec.vocab_size, size=positions.shape)
    shown = np.where(
        draw < spec.mask_share,
        spec.mask_id,
        np.where(draw < spec.mask_share + spec.random_share, random_ids, original),
    )
    masked = ids.copy()
    lead = np.nonzero(used)
    masked[(*lead[:-1], positions[used])] = shown[used]
    return masked.astype(ids.dtype), positions, labels


@struct.dataclass(kw_only=True)
class MaskedBatch(Batch):
    """Padded rows with masked tokens, for the MLM head: `positions` [B, P] are the predicted
    token positions and `labels` [B, P] their original ids (IGNORE in unused slots).

    The positions are a model input (the head gathers those rows before its vocabulary matmul),
    so they travel in `layout()`, the batch's extra keyword arguments to the model's apply."""

    positions: Array  # int32 [B, P]

    def layout(self) -> dict[str, Array]:
        return {"positions": self.positions}


def mask_batch(batch: Batch, spec: MaskingSpec, rng: np.random.Generator) -> MaskedBatch:
    """`batch` (any leading axes) with masked input ids, prediction positions and labels; rows
    with example_mask 0 (padding) predict nothing."""
    attention = np.asarray(batch.attention_mask)
    if batch.example_mask is not None:
        attention = attention * (np.asarray(batch.example_mask)[..., None] > 0)
    ids, positions, labels = mask_tokens(batch.input_ids, attention, spec, rng)
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    fields.update(input_ids=ids, labels=labels, positions=positions)
    return MaskedBatch(**fields)
