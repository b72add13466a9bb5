"""Model FLOP accounting for BERT, so benchmarks can report utilisation against a measured peak.

Counts only matrix-multiply FLOPs (2 per multiply-add), the convention of MFU reports: layer norms,
softmax, GELU and the optimiser update are real work but are not "model FLOPs", so a run spending
time on them shows up as lower utilisation rather than being hidden.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

import numpy as np


class _Shape(Protocol):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_labels: int


def forward_flops(config: _Shape, batch: int, seq_len: int, num_layers: int | None = None) -> int:
    """Matmul FLOPs of one forward pass over `batch` sequences of `seq_len` tokens.

    Per layer and token: Q, K, V and attention output projections (4 * 2 * H * H), the feed-forward
    pair (2 * 2 * H * I), and attention scores plus the weighted sum (2 * 2 * T * H). Pooler and
    classifier act on the [CLS] token only.
    """
    h, i = config.hidden_size, config.intermediate_size
    layers = config.num_hidden_layers if num_layers is None else num_layers
    t = seq_len
    per_layer = batch * t * (8 * h * h + 4 * h * i + 4 * t * h)
    head = batch * (2 * h * h + 2 * h * config.num_labels)
    return layers * per_layer + head


def train_step_flops(config: _Shape, batch: int, seq_len: int) -> int:
    """Forward plus backward: the backward pass costs two forward passes (gradients with respect to
    activations and to weights), the usual 3x convention."""
    return 3 * forward_flops(config, batch, seq_len)


def packed_forward_flops(
    config: _Shape, tokens: int, rows: int, row_width: int, examples: int
) -> int:
    """Matmul FLOPs of one forward pass over a packed batch (`model.Layout`): the token-wise
    matmuls over the `tokens` stream positions, attention over `rows` rows of `row_width` slots,
    pooler and classifier over the `examples`."""
    h, i = config.hidden_size, config.intermediate_size
    per_layer = tokens * (8 * h * h + 4 * h * i) + rows * row_width * 4 * row_width * h
    head = examples * (2 * h * h + 2 * h * config.num_labels)
    return config.num_hidden_layers * per_layer + head


def segment_train_flops(config: _Shape, segment: Any, skip_masked_steps: bool = False) -> int:
    """Matmul FLOPs a training segment [K, S, ...] computes, padding included (hardware FLOPs).

    Masked steps count unless `skip_masked_steps` (clients one at a time skip them)."""
    steps_mask = segment.step_mask
    steps = int(steps_mask.sum()) if skip_masked_steps else int(steps_mask.size)
    if segment.packed:
        rows, width = segment.attention_mask.shape[-2:]
        per_step = packed_forward_flops(
            config, segment.input_ids.shape[-1], rows, width, segment.cls_index.shape[-1]
        )
    else:
        per_step = forward_flops(config, *segment.input_ids.shape[-2:])
    return 3 * per_step * steps


def mlm_train_flops(
    config: _Shape,
    batch: int,
    seq_len: int,
    predictions: int,
    *,
    layers: int,
    trained_layers: Collection[int],
    embeddings_trained: bool,
    head_trained: bool = True,
) -> int:
    """Matmul FLOPs of one masked-LM training step of a `layers`-layer model, counted as
    reverse-mode autodiff runs it when only some parameters are trained (FedBFPT trains one
    layer and the head; BERT-FL everything).

    Every matmul runs forward (F). Backward, a matmul computes the gradient of its weight only
    if that weight is trained (W), and the gradient of an activation only if something trained
    lies below it (A): layers below the lowest trained one run forward only; a trained layer
    with nothing trained beneath skips its input's gradient (the Q/K/V projections' dx); the
    layers above run F + A. Per token and layer: projections and feed-forward 8H^2 + 4HI
    (F, W and A alike), attention scores and weighted sum 4TH (F) and 8TH (A: both operands).
    The head runs on `predictions` rows per sequence (the prediction slots): transform 2H^2,
    tied decoder 2HV, whose weight gradient exists only when the word embeddings are trained.
    Embedding lookups, LayerNorm, softmax, GELU and the optimiser are not matmuls (see above).
    """
    h, v, t = config.hidden_size, _vocab(config), seq_len
    tokens, rows = batch * seq_len, batch * predictions
    trained = set(trained_layers)
    total = _encoder_train_flops(
        config, layers, tokens, tokens * 4 * t * h, trained, embeddings_trained
    )
    anything = embeddings_trained or bool(trained) or head_trained
    total += rows * (2 * h * h + 2 * h * v)  # forward: transform, decoder
    if head_trained:
        total += rows * 2 * h * h  # transform weight gradient
    if embeddings_trained:
        total += rows * 2 * h * v  # decoder weight gradient (the tied word embeddings)
    if anything:
        total += rows * 2 * h * v  # decoder input gradient
    if embeddings_trained or trained:
        total += rows * 2 * h * h  # transform input gradient
    return total


def _encoder_train_flops(
    config: _Shape,
    layers: int,
    tokens: int,
    attention: int,
    trained: Collection[int],
    embeddings_trained: bool,
) -> int:
    """Matmul FLOPs of `layers` encoder layers in one training step (the rules of
    `mlm_train_flops`): dense matmuls on `tokens` positions, `attention` the FLOPs of one layer's
    forward attention matmuls (scores and weighted sum), whose backward costs twice that."""
    h, i = config.hidden_size, config.intermediate_size
    dense, qkv_input = tokens * (8 * h * h + 4 * h * i), tokens * 6 * h * h
    total = 0
    for layer in range(layers):
        below = embeddings_trained or any(j < layer for j in trained)
        total += dense + attention  # forward
        if layer in trained:
            total += dense  # weight gradients
        if below or layer in trained:
            total += dense - qkv_input + 2 * attention  # gradients inside the layer
            if below:
                total += qkv_input  # the Q/K/V projections' input gradient
    return total


def train_flops(
    config: _Shape,
    *,
    tokens: int,
    rows: int,
    row_width: int,
    examples: int,
    trained_layers: Collection[int],
    embeddings_trained: bool,
    pooler_trained: bool,
    classifier_trained: bool,
) -> int:
    """Matmul FLOPs of one training step of a sequence- or token-classification model
    (`config.head`), counted as reverse-mode autodiff runs it when only some parameters are
    trained (BERT-FL trains everything, FedBT the top layers and the task head, FedPer-style
    runs the classifier only), so a benchmark's utilisation counts the work actually done.

    Shape: dense matmuls run on `tokens` positions (padded B * T; packed, the stream's N),
    attention on `rows` rows of `row_width` slots (padded B, T; packed, attention_mask's
    [R, W]), the sequence head on `examples` rows (padded B; packed, cls_index's length).
    Encoder: the rules of `mlm_train_flops`; `embeddings_trained` (any embedding parameter)
    makes gradients flow into layer 0's input. Head: the sequence head's pooler (H x H) on
    the [CLS] rows, then its classifier (H x C); the token head's classifier (H x C) on every
    token position, no pooler (`pooler_trained` is then ignored). Each head matmul runs forward;
    backward, its weight gradient only if that weight is trained, its input gradient only if
    something upstream of it (the pooler, the encoder, the embeddings) is trained.
    """
    h, c = config.hidden_size, config.num_labels
    trained = set(trained_layers)
    if not trained <= set(range(config.num_hidden_layers)):
        raise ValueError(f"trained layers {sorted(trained)} outside the model's layers")
    encoder = embeddings_trained or bool(trained)  # gradients reach the encoder's output
    attention = rows * row_width * 4 * row_width * h
    total = _encoder_train_flops(
        config, config.num_hidden_layers, tokens, attention, trained, embeddings_trained
    )
    if config.head == "token":
        return total + tokens * 2 * h * c * (1 + classifier_trained + encoder)
    if config.head != "sequence":
        raise ValueError(f"head {config.head!r}: use mlm_train_flops for the masked-LM head")
    total += examples * 2 * h * h * (1 + pooler_trained + encoder)  # pooler: F, W, A
    below = encoder or pooler_trained
    return total + examples * 2 * h * c * (1 + classifier_trained + below)  # classifier


def segment_flops(
    config: _Shape,
    segment: Any,
    *,
    trained_layers: Collection[int],
    embeddings_trained: bool,
    pooler_trained: bool,
    classifier_trained: bool,
) -> int:
    """Matmul FLOPs of the real steps of a training segment (a `data.batch.Batch`, [S, ...] for
    one client or [K, S, ...]): `train_flops` per step, its shape read from the batch (packed or
    padded), times the steps that run for real. A real step, as
    `sim.round_progress.real_counts` counts them, is one whose step_mask is true (None: every
    step) and that holds an example: the padding steps a stacked round computes are not model
    work."""
    ids = segment.input_ids
    if segment.packed:
        lead = ids.shape[:-1]
        rows, width = segment.attention_mask.shape[-2:]
        shape = dict(tokens=ids.shape[-1], rows=rows, row_width=width,
                     examples=segment.cls_index.shape[-1])  # fmt: skip
    else:
        lead, (b, t) = ids.shape[:-2], ids.shape[-2:]
        shape = dict(tokens=b * t, rows=b, row_width=t, examples=b)
    real = np.ones(lead, bool)
    if segment.example_mask is not None:
        real &= np.asarray(segment.example_mask).reshape(*lead, -1).sum(-1) > 0
    if segment.step_mask is not None:
        real &= np.asarray(segment.step_mask, bool).reshape(lead)
    per_step = train_flops(
        config, **shape, trained_layers=trained_layers, embeddings_trained=embeddings_trained,
        pooler_trained=pooler_trained, classifier_trained=classifier_trained,
    )  # fmt: skip
    return int(real.sum()) * per_step


def _vocab(config: Any) -> int:
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        raise ValueError("MLM FLOPs need the config's vocab_size")
    return int(vocab)
