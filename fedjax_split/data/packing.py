"""Packed batches: a step's examples end to end in one token stream, attention in rows.

Packing (`Batching(packing=True)`, the default) lays a step's examples end to end in one token
stream input_ids / token_type_ids / position_ids [1, N] that every token-wise layer computes, so
padding costs nothing whatever the batch's mix of lengths. Attention runs on R rows of W slots
([1, R, W]: attention_mask = batch slot + 1 or 0, row_tokens = stream position), filled first-fit
decreasing; token_slots [1, N] and cls_index [1, B] map back (`models.attention.Layout`). A token
task's labels follow the stream ([1, N]).

A step's examples go into one or more *parts* of the run's one shape, N stream tokens, R =
ceil(N / W) + 1 attention rows of W slots and B example slots (`part_members`): a step whose
tokens do not fit one part continues in the next (first fit, longest first), and the client
program accumulates the parts' gradients and updates once at the step's last part. Evaluation
parts take the examples in order, as many as fit (`eval_part_members`).

Dropout (`models.dropout.dropout`) draws each element's mask from its flat index, so growing a
leading axis (a packed stream's tokens, attention rows) when clients are stacked leaves every
real token's masks as they were: a packed client trains bit for bit the same model alone or
stacked.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedjax_split.data.batch import PackedBatch
from fedjax_split.data.flat_tokens import Packed
from fedjax_split.tasks.objectives import IGNORE


def rows_per_part(part_tokens: int, row_width: int) -> int:
    """R of a packed part: the rows N tokens fill, and one more for first fit's gaps."""
    return -(-part_tokens // row_width) + 1


def first_fit(lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """First-fit decreasing bin packing: (row, column) of each example's first token, rows used."""
    order = np.argsort(-lengths, kind="stable")
    free: list[int] = []
    row = np.zeros(lengths.size, np.int64)
    col = np.zeros(lengths.size, np.int64)
    for i in order:
        n = int(lengths[i])
        r = next((j for j, f in enumerate(free) if f >= n), len(free))
        if r == len(free):
            free.append(width)
        row[i], col[i] = r, width - free[r]
        free[r] -= n
    return row, col, len(free)


def _fits(free: list[int], used: int, n: int, part_tokens: int, rows: int) -> int | None:
    """The row (first fit) where an example of n tokens goes in a part with rows `free` and
    `used` tokens; len(free) for a new row; None if it does not fit the part."""
    if used + n > part_tokens:
        return None
    row = next((j for j, f in enumerate(free) if f >= n), len(free))
    return row if row < rows else None


def part_members(lengths: np.ndarray, part_tokens: int, row_width: int) -> list[np.ndarray]:
    """A training step's examples (positions into `lengths`) in parts: longest first, each into
    the first part where it fits (first fit over the parts' rows), a new part when none has room.
    Within a part this is `first_fit`'s own order, so the part assembles as placed."""
    rows = rows_per_part(part_tokens, row_width)
    parts: list[tuple[list[int], list[int], list[int]]] = []  # (members, free rows, [tokens])
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        fits = ((p, _fits(p[1], p[2][0], n, part_tokens, rows)) for p in parts)
        part, row = next(((p, r) for p, r in fits if r is not None), (None, 0))
        if part is None:
            part = ([], [], [0])
            parts.append(part)
        members, free, used = part
        if row == len(free):
            free.append(row_width)
        free[row] -= n
        used[0] += n
        members.append(int(i))
    return [np.sort(np.asarray(m, np.int64)) for m, _, _ in parts]


def eval_part_members(
    lengths: np.ndarray, batch_size: int, part_tokens: int, row_width: int
) -> list[np.ndarray]:
    """Test examples in order, as many as fit each packed part (B slots, N tokens, R rows as
    `assemble_packed` fills them: first fit, longest first)."""
    rows = rows_per_part(part_tokens, row_width)
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths.tolist()):
        fits = (len(current) < batch_size and used + n <= part_tokens
                and first_fit(lengths[[*current, i]], row_width)[2] <= rows)  # fmt: skip
        if current and not fits:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    return [np.asarray(g, np.int64) for g in [*groups, current] if g]


def _blank_stream(
    shape: tuple[int, int, int], num_tokens: int, num_rows: int, row_width: int, pad_id: int,
    token_labels: bool,
) -> dict[str, np.ndarray]:  # fmt: skip
    """The arrays of a packed batch of `shape` (K, S, B) before any example is laid in: pad ids,
    IGNORE token labels (a token task's), zeros elsewhere; keyed by `PackedBatch` field."""
    k, s, b = shape
    flat = (k, s, num_tokens)
    grid = (k, s, num_rows, row_width)
    arrays = {
        "input_ids": np.full(flat, pad_id, np.int32),
        "token_type_ids": np.zeros(flat, np.int32),
        "position_ids": np.zeros(flat, np.int32),
        "token_slots": np.zeros(flat, np.int32),
        "row_tokens": np.zeros(grid, np.int32),
        "attention_mask": np.zeros(grid, np.int32),  # each slot's batch slot + 1, 0 = empty
        "cls_index": np.zeros((k, s, b), np.int32),
    }
    if token_labels:
        arrays["labels"] = np.full(flat, IGNORE, np.int32)
    return arrays


def _lay_out_step(
    step: dict[str, np.ndarray], packed: Packed, pool_rows: np.ndarray, num_tokens: int,
    num_rows: int, row_width: int,
) -> None:  # fmt: skip
    """Writes one step's examples (pool indices `pool_rows` [B], -1 = padding) into its arrays
    `step` (views of `_blank_stream`'s at one client and step): rows filled first-fit
    decreasing, the stream in row-major slot order."""
    (slots,) = np.nonzero(pool_rows >= 0)
    lens = packed.lengths[pool_rows[slots]]
    r, c, used = first_fit(lens, row_width)
    if used > num_rows or lens.sum() > num_tokens:
        raise AssertionError("a batch does not fit the run's packed shape")
    grid_tokens = step["row_tokens"].reshape(-1)
    grid_examples = step["attention_mask"].reshape(-1)
    at = 0
    for e in np.lexsort((c, r)):  # stream order = row-major slot order
        n, start = int(lens[e]), int(packed.offsets[pool_rows[slots[e]]])
        stream, source = slice(at, at + n), slice(start, start + n)
        slot = r[e] * row_width + c[e] + np.arange(n)
        step["input_ids"][stream] = packed.input_ids[source]
        step["token_type_ids"][stream] = packed.token_type_ids[source]
        if "labels" in step:
            step["labels"][stream] = packed.labels[source]
        step["position_ids"][stream] = np.arange(n)
        step["token_slots"][stream] = slot
        grid_tokens[slot] = np.arange(at, at + n)
        grid_examples[slot] = slots[e] + 1
        step["cls_index"][slots[e]] = at
        at += n


def assemble_packed(
    packed: Packed,
    rows: np.ndarray,
    steps_real: np.ndarray,
    labels: np.ndarray,
    num_tokens: int,
    num_rows: int,
    row_width: int,
    label_dtype: Any,
    pad_id: int,
) -> PackedBatch:
    """Gathers a packed batch from pool indices `rows` [K, S, B] (-1 = padding).

    Each step's real tokens lie end to end in a flat stream of `num_tokens` positions ([K, S, N]:
    input_ids, token_type_ids, position_ids restarting at 0 per example), which every token-wise
    layer computes. Attention runs on `num_rows` rows of `row_width` slots ([K, S, R, W]), filled
    first-fit decreasing: `row_tokens` names the stream position in each slot, `token_slots` the
    slot of each stream position, `attention_mask` each slot's batch slot + 1 (0 = empty slot),
    and `cls_index` [K, S, B] each example's first stream position. A token task's labels
    follow the stream ([K, S, N], IGNORE on padding).
    """
    arrays = _blank_stream(rows.shape, num_tokens, num_rows, row_width, pad_id,
                           token_labels=packed.labels is not None)  # fmt: skip
    for i in range(rows.shape[0]):
        for j in range(rows.shape[1]):
            step = {name: a[i, j] for name, a in arrays.items()}
            _lay_out_step(step, packed, rows[i, j], num_tokens, num_rows, row_width)
    real = rows >= 0
    stream_labels = arrays.pop("labels", None)
    safe = np.where(real, rows, 0)
    example_labels = np.where(real, labels[safe], 0) if stream_labels is None else stream_labels
    return PackedBatch(
        **arrays,
        labels=example_labels.astype(label_dtype),
        example_mask=real.astype(np.float32),
        step_mask=steps_real,
        example_index=rows.astype(np.int32),
    )
