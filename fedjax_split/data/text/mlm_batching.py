"""A client's MLM training steps for one round: shuffled batches of its sequences, masked afresh.

Sequences (`text_corpora.sequences`) all have one width T, so every batch has the shape [B, T]
and a client's steps are cut into segments of a fixed number of steps S ([S, B, T]; the last one
padded with masked steps, step_mask False, which the client update skips): one compiled program
serves every client, round and epoch. That is why this is not `batching.client_batches`, which
packs sentences of very different lengths into parts of one shape (a step may span several):
here the document stream makes all sequences full but a client's last, and S steps a call cut
the host's dispatches.

Randomness: `seed` is a sequence such as [run seed, round, client]; each epoch's order comes from
`default_rng([*seed, SHUFFLE, epoch])` and the masks from `default_rng([*seed, MASK])`, so a
client's batches depend on its own data and those numbers only.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from fedjax_split.data.batch import Batch
from fedjax_split.data.text.masking import MaskedBatch, MaskingSpec, mask_batch
from fedjax_split.data.text.text_corpora import Sequences

SHUFFLE, MASK = 0x73_68, 0x6D_6B  # "sh", "mk": `purpose` parts of the numpy seeds


def _rows(seqs: Sequences, rows: np.ndarray, pad_id: int) -> Batch:
    """Rows [..., B] of `seqs` (-1: a padding row, which attends to position 0 only)."""
    real = rows >= 0
    safe = np.where(real, rows, 0)
    ids = np.where(real[..., None], seqs.input_ids[safe], pad_id).astype(np.int32)
    attention = np.where(real[..., None], seqs.attention_mask[safe], 0).astype(np.int32)
    attention[..., 0] = 1
    return Batch(
        input_ids=ids,
        attention_mask=attention,
        token_type_ids=np.zeros_like(ids),
        example_mask=real.astype(np.float32),
        example_index=rows.astype(np.int32),
    )


def train_segments(
    seqs: Sequences,
    *,
    batch_size: int,
    epochs: int,
    steps_per_segment: int,
    masking: MaskingSpec,
    seed: Sequence[int],
    pad_id: int = 0,
) -> list[MaskedBatch]:
    """Segments [S, B, T] of masked batches: `epochs` passes over `seqs` in a fresh random order
    each, in batches of `batch_size` (an epoch's last batch may be partial)."""
    if batch_size < 1 or epochs < 1 or steps_per_segment < 1:
        raise ValueError("batch_size, epochs and steps_per_segment must be >= 1")
    n = seqs.input_ids.shape[0]
    steps = []
    for e in range(epochs):
        order = np.random.default_rng([*seed, SHUFFLE, e]).permutation(n)
        for i in range(0, n, batch_size):
            row = np.full(batch_size, -1, np.int64)
            part = order[i : i + batch_size]
            row[: part.size] = part
            steps.append(row)
    if not steps:
        return []
    total = -(-len(steps) // steps_per_segment) * steps_per_segment
    rows = np.full((total, batch_size), -1, np.int64)
    rows[: len(steps)] = np.stack(steps)
    step_mask = np.arange(total) < len(steps)
    rng = np.random.default_rng([*seed, MASK])
    out = []
    for s in range(0, total, steps_per_segment):
        batch = _rows(seqs, rows[s : s + steps_per_segment], pad_id)
        batch = batch.replace(step_mask=step_mask[s : s + steps_per_segment])
        out.append(mask_batch(batch, masking, rng))
    return out


def eval_batches(
    seqs: Sequences,
    *,
    batch_size: int,
    masking: MaskingSpec,
    seed: Sequence[int],
    pad_id: int = 0,
) -> list[MaskedBatch]:
    """Masked batches [B, T] of `seqs` in order. All rows are masked at once from
    `default_rng([*seed, MASK])`, before batching: the same held-out predictions every round,
    for every method and whatever the batch size."""
    n = seqs.input_ids.shape[0]
    rows = np.full(-(-n // batch_size) * batch_size, -1, np.int64)
    rows[:n] = np.arange(n)
    masked = mask_batch(_rows(seqs, rows, pad_id), masking, np.random.default_rng([*seed, MASK]))
    return [
        jax.tree.map(lambda x, i=i: x[i : i + batch_size], masked)
        for i in range(0, rows.size, batch_size)
    ]
