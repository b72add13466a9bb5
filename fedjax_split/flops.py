"""Model FLOP accounting for BERT, so benchmarks can report utilisation against a measured peak.

Counts only matrix-multiply FLOPs (2 per multiply-add), the convention of MFU reports: layer norms,
softmax, GELU and the optimiser update are real work but are not "model FLOPs", so a run spending
time on them shows up as lower utilisation rather than being hidden.
"""

from __future__ import annotations

from typing import Protocol


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
