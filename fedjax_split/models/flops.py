"""Model FLOP accounting for BERT, so benchmarks can report utilisation against a measured peak.

Counts only matrix-multiply FLOPs (2 per multiply-add), the convention of MFU reports: layer norms,
softmax, GELU and the optimiser update are real work but are not "model FLOPs", so a run spending
time on them shows up as lower utilisation rather than being hidden.
"""

from __future__ import annotations

from typing import Any, Protocol


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
