"""Per-client mini-batches stacked on a leading client axis, with step masks and length bucketing.

A *segment* is a typed batch (`data.batch.Batch`, or `PackedBatch` with packing) of numpy
arrays with a client axis K and a step axis S (see docs/architecture.md): input_ids /
attention_mask / token_type_ids int32 [K, S, B, T], labels [K, S, B] (int32, float32 for
regression; a token task's int32 [K, S, B, T], IGNORE where no label is: see data.objectives),
example_mask float32 [K, S, B], step_mask bool [K, S], and example_index int32 [K, S, B] (pool
index of each row, -1 for padding; the client update ignores it, evaluation uses it to map
predictions back to examples). Segments are consumed in order; T differs between segments.

Why bucketing: sentence tasks average about 25 tokens, so padding every batch to the longest
example computes mostly padding. With `bucketing=True` (default) the order of a client's SGD steps
is built as follows, deterministically from `seed`:
1. each epoch, the client's examples are shuffled, then sorted by length inside windows of
   `window` batches (default 200) and cut into batches of B: a batch holds examples of similar
   length, drawn from a random window (only one batch per epoch can be partial: the one with
   the shortest examples of the last window);
2. the client's batches of the epoch are ranked by length and cut at shared quantile cut points
   into at most `num_buckets` buckets (the cut points are chosen to minimise computed tokens);
3. each epoch visits the buckets in a random order shared by all clients and, inside a bucket,
   the client's batches in random order. One segment per (epoch, bucket).
Effect on SGD: every example is still seen exactly once per epoch and epochs stay in order, but
within an epoch the steps come in runs of similar length (a mild curriculum that changes every
epoch) and a batch's examples are correlated in length. `bucketing=False` gives plain shuffled
batches in one segment padded to the longest example.
Every client's step count per epoch is the same in every epoch, and a bucket keeps one (S, T) over
all epochs, so a jitted scan compiles at most `num_buckets` shapes.
Measured padding waste (real rotten tomatoes, MiniLM WordPiece, mean 27 tokens, paper partition,
3 epochs, B = 8/16/32): K=3 13.3/13.7/13.0%, K=10 15.7/16.5/18.7%; 66% without bucketing. The
floor is 11.4% (every example rounded up to a multiple of 8 on its own).

Packing (`packing=True`) removes the padding inside a batch instead of sorting it away: a step's
examples lie end to end in one token stream input_ids / token_type_ids / position_ids [K, S, N]
(N: the bucket's most real tokens, rounded up to a ladder of 16 sizes per power of two so that
shapes recur from round to round), which every token-wise layer computes. Attention runs on R rows
of W >= `pack_width` slots ([K, S, R, W]: attention_mask = batch slot + 1 or 0, row_tokens = stream
position), filled first-fit decreasing; token_slots [K, S, N] and cls_index [K, S, B] map back
(`model.Layout`). Batches are then plain shuffled ones (no length windows: a mixed batch packs as
well as a sorted one), bucketed by their real tokens. Measured on real rotten-tomatoes lengths,
K=10, B=16, mean over 10 rounds: 12.9% of the stream is padding at 64 examples per client and 1
epoch, 13.7% at 80 and 2 epochs, 9.7% at 160 (padded batches: 32%, 35%, 21%). Clients trained one
at a time run on their own parts (`client_segments`), cut to the round's smallest shape that holds
them: in the benchmark's round (64 examples, 1 epoch) 14.2% -> 7.3%, with no extra compilation.
The padding rows below apply to padded segments only.

Padding rows (example_mask 0) get input_ids = pad_id and attend to position 0 only, so a model
never sees an all-masked attention row (which could produce NaN that a zero weight cannot cancel).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fedjax_split.data.batch import Batch, PackedBatch
from fedjax_split.data.objectives import CLASSIFICATION, IGNORE, Classification

Segment = Batch  # a Batch (or PackedBatch) with leading [K, S] axes
_TAG_CLIENT = 0x63_6C_69  # "cli"
_TAG_ORDER = 0x6F_72_64  # "ord"
_GRID = 256  # candidate bucket cut points: quantiles j / _GRID of each client's batch ranks


class Packed(NamedTuple):
    """Ragged token ids in one flat array (what batching gathers from)."""

    input_ids: np.ndarray  # int32 [total tokens]
    token_type_ids: np.ndarray  # int32 [total tokens]
    offsets: np.ndarray  # int64 [N]
    lengths: np.ndarray  # int64 [N]
    labels: np.ndarray | None = None  # int32 [total tokens]: a token task's labels (IGNORE: none)


def pack(tokenized: Any) -> Packed:
    """Flattens a `tokenization.Tokenized` (ragged lists of int32 arrays); Packed passes through.

    A Tokenized with per-token `labels` (token tasks) keeps them aligned with the tokens."""
    if isinstance(tokenized, Packed):
        return tokenized
    lengths = np.asarray([len(a) for a in tokenized.input_ids], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    ids = np.concatenate(tokenized.input_ids).astype(np.int32) if lengths.size else np.zeros(0)
    tt = tokenized.token_type_ids
    types = np.concatenate(tt).astype(np.int32) if tt is not None and lengths.size else None
    if types is None:
        types = np.zeros(ids.shape, np.int32)
    if types.shape != ids.shape:
        raise ValueError("token_type_ids and input_ids differ in length")
    token_labels = getattr(tokenized, "labels", None)
    if token_labels is not None:
        token_labels = (
            np.concatenate(token_labels).astype(np.int32) if lengths.size else np.zeros(0, np.int32)
        )
        if token_labels.shape != ids.shape:
            raise ValueError("token labels and input_ids differ in length")
    return Packed(ids.astype(np.int32), types, offsets, lengths, token_labels)


def _seed_list(seed: int | Sequence[int]) -> list[int]:
    return [int(s) for s in (seed if isinstance(seed, Sequence) else [seed])]


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _ladder(n: int, multiple: int, steps_per_octave: int = 16) -> int:
    """n rounded up to a multiple and to one of `steps_per_octave` points per power of two (at
    most 6.25% apart): packed token counts vary with every round's batches, and a ladder lets
    their shapes, hence compilations, recur (on rotten tomatoes, K=10: 12-18 shapes in 10
    rounds instead of 16-38, for 1-3 points more padding)."""
    n = max(int(n), 1)
    step = max(multiple, 2 ** (n.bit_length() - 1) // steps_per_octave)
    return _round_up(n, step)


def _width(longest: int, pad_to_multiple: int, max_length: int | None) -> int:
    """T: longest length rounded up to the multiple, not past max_length (never truncating)."""
    t = _round_up(max(longest, 1), pad_to_multiple)
    if max_length is not None:
        t = min(t, max(max_length, longest))
    return t


def _epoch_batches(
    lengths: np.ndarray, batch_size: int, rng: np.random.Generator | None, window: int | None
) -> list[np.ndarray]:
    """One epoch of one client: batches of local positions (shuffled; length-sorted in windows)."""
    n = lengths.size
    order = rng.permutation(n) if rng is not None else np.arange(n)
    if window is None or n == 0:
        return [order[i : i + batch_size] for i in range(0, n, batch_size)]
    span = window * batch_size
    batches = []
    for c in np.split(order, range(span, n, span)):
        c = c[np.argsort(lengths[c], kind="stable")]
        # The partial batch (only in the last window) takes that window's shortest examples, so
        # its padding rows are narrow.
        first = c.size % batch_size
        cuts = ([first] if 0 < first < c.size else []) + list(
            range(first + batch_size, c.size, batch_size)
        )
        batches.extend(np.split(c, cuts))
    return batches


def _cut_positions(num_batches: np.ndarray, grid: int) -> np.ndarray:
    """[K, grid+1] batch-rank positions of the quantile cut points j/grid for each client."""
    j = np.arange(grid + 1)
    return np.floor(num_batches[:, None] * j[None, :] / grid + 0.5).astype(np.int64)


def _choose_cuts(sorted_max: np.ndarray, pos: np.ndarray, num_buckets: int, width) -> list[int]:
    """Grid cut points (indices into 0..grid) minimising sum over buckets of S_g * T_g (DP).

    sorted_max[i, j]: the longest batch (over epochs) among client i's batches of rank < pos[i, j].
    """
    grid = pos.shape[1] - 1
    big = np.iinfo(np.int64).max // 4
    cost = np.full((grid + 1, grid + 1), big, dtype=np.int64)
    widths = np.array([width(int(x)) for x in range(int(sorted_max.max()) + 1)], dtype=np.int64)
    for a in range(grid):
        count = pos[:, a + 1 :] - pos[:, a : a + 1]  # [K, grid - a]: bucket (a, b) per client
        longest = np.max(np.where(count > 0, sorted_max[:, a + 1 :], 0), axis=0)
        cost[a, a + 1 :] = count.max(axis=0) * widths[longest]
    best = np.full((num_buckets + 1, grid + 1), big, dtype=np.int64)
    back = np.zeros((num_buckets + 1, grid + 1), dtype=np.int64)
    best[0, 0] = 0
    for g in range(1, num_buckets + 1):
        totals = best[g - 1][:, None] + cost  # [a, b]; cost is `big` where a >= b
        back[g] = np.argmin(totals, axis=0)
        best[g] = np.minimum(totals[back[g], np.arange(grid + 1)], big)
    g = int(np.argmin(best[1:, grid])) + 1
    cuts = [grid]
    while g > 0:
        cuts.append(int(back[g, cuts[-1]]))
        g -= 1
    return cuts[::-1]


def _assemble(
    packed: Packed,
    rows: np.ndarray,
    steps_real: np.ndarray,
    labels: np.ndarray,
    width: int,
    label_dtype: Any,
    pad_id: int,
) -> Segment:
    """Gathers a segment from pool indices `rows` [K, S, B] (-1 = padding). A token task's
    labels are [K, S, B, T], IGNORE on padding."""
    real = rows >= 0
    safe = np.where(real, rows, 0)
    lengths = np.where(real, packed.lengths[safe], 0)
    pos = np.arange(width)
    valid = pos < lengths[..., None]
    gather = np.where(valid, packed.offsets[safe][..., None] + pos, 0)
    input_ids = np.where(valid, packed.input_ids[gather] if packed.input_ids.size else 0, pad_id)
    types = np.where(valid, packed.token_type_ids[gather] if packed.input_ids.size else 0, 0)
    attention = valid.copy()
    attention[..., 0] |= ~real  # padding rows attend to position 0 only (no empty softmax row)
    if packed.labels is not None:
        seg_labels = np.where(valid, packed.labels[gather] if packed.input_ids.size else 0, IGNORE)
    else:
        seg_labels = np.where(real, labels[safe], 0)
    seg_labels = seg_labels.astype(label_dtype)
    return Batch(
        input_ids=input_ids.astype(np.int32),
        attention_mask=attention.astype(np.int32),
        token_type_ids=types.astype(np.int32),
        labels=seg_labels,
        example_mask=real.astype(np.float32),
        step_mask=steps_real,
        example_index=rows.astype(np.int32),
    )


def _first_fit(lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, int]:
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


def _assemble_packed(
    packed: Packed,
    rows: np.ndarray,
    steps_real: np.ndarray,
    labels: np.ndarray,
    num_tokens: int,
    num_rows: int,
    row_width: int,
    label_dtype: Any,
    pad_id: int,
) -> Segment:
    """Gathers a packed segment from pool indices `rows` [K, S, B] (-1 = padding).

    Each step's real tokens lie end to end in a flat stream of `num_tokens` positions ([K, S, N]:
    input_ids, token_type_ids, position_ids restarting at 0 per example), which every token-wise
    layer computes. Attention runs on `num_rows` rows of `row_width` slots ([K, S, R, W]), filled
    first-fit decreasing: `row_tokens` names the stream position in each slot, `token_slots` the
    slot of each stream position, `attention_mask` each slot's batch slot + 1 (0 = empty slot),
    and `cls_index` [K, S, B] each example's first stream position. A token task's labels
    follow the stream ([K, S, N], IGNORE on padding).
    """
    k, s, b = rows.shape
    flat = (k, s, num_tokens)
    ids = np.full(flat, pad_id, np.int32)
    stream_labels = np.full(flat, IGNORE, np.int32) if packed.labels is not None else None
    types = np.zeros(flat, np.int32)
    positions = np.zeros(flat, np.int32)
    token_slots = np.zeros(flat, np.int32)
    row_tokens = np.zeros((k, s, num_rows, row_width), np.int32)
    example_no = np.zeros((k, s, num_rows, row_width), np.int32)
    cls_index = np.zeros((k, s, b), np.int32)
    real = rows >= 0
    for i in range(k):
        for j in range(s):
            (slots,) = np.nonzero(real[i, j])
            lens = packed.lengths[rows[i, j, slots]]
            r, c, used = _first_fit(lens, row_width)
            if used > num_rows or lens.sum() > num_tokens:
                raise AssertionError("a batch does not fit its bucket's packed shape")
            at = 0
            for e in np.lexsort((c, r)):  # stream order = row-major slot order
                n, start = int(lens[e]), int(packed.offsets[rows[i, j, slots[e]]])
                stream = slice(at, at + n)
                slot = r[e] * row_width + c[e] + np.arange(n)
                ids[i, j, stream] = packed.input_ids[start : start + n]
                types[i, j, stream] = packed.token_type_ids[start : start + n]
                if stream_labels is not None:
                    stream_labels[i, j, stream] = packed.labels[start : start + n]
                positions[i, j, stream] = np.arange(n)
                token_slots[i, j, stream] = slot
                row_tokens[i, j].reshape(-1)[slot] = np.arange(at, at + n)
                example_no[i, j].reshape(-1)[slot] = slots[e] + 1
                cls_index[i, j, slots[e]] = at
                at += n
    safe = np.where(real, rows, 0)
    example_labels = np.where(real, labels[safe], 0) if stream_labels is None else stream_labels
    return PackedBatch(
        input_ids=ids,
        attention_mask=example_no,
        token_type_ids=types,
        position_ids=positions,
        row_tokens=row_tokens,
        token_slots=token_slots,
        cls_index=cls_index,
        labels=example_labels.astype(label_dtype),
        example_mask=real.astype(np.float32),
        step_mask=steps_real,
        example_index=rows.astype(np.int32),
    )


def _stack(batches: list[list[np.ndarray]], batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-client lists of batches -> rows [K, S, B] (-1 padding) and step_mask [K, S]."""
    k = len(batches)
    s = max((len(b) for b in batches), default=0)
    rows = np.full((k, s, batch_size), -1, dtype=np.int64)
    steps = np.zeros((k, s), dtype=bool)
    for i, client in enumerate(batches):
        for j, b in enumerate(client):
            rows[i, j, : b.size] = b
            steps[i, j] = True
    return rows, steps


def _build(
    tokenized: Any,
    client_indices: Sequence[np.ndarray],
    labels: np.ndarray,
    *,
    batch_size: int,
    epochs: int,
    seed: int | Sequence[int],
    shuffle: bool,
    pad_to_multiple: int,
    objective: Classification,
    bucketing: bool,
    num_buckets: int,
    window: int | None,
    max_length: int | None,
    pad_id: int,
    client_ids: Sequence[int] | None = None,
    packing: bool = False,
    pack_width: int = 64,
) -> list[Segment]:
    if batch_size < 1 or epochs < 1 or pad_to_multiple < 1 or num_buckets < 1:
        raise ValueError("batch_size, epochs, pad_to_multiple and num_buckets must be >= 1")
    if len(client_indices) == 0:
        raise ValueError("no clients")
    packed = pack(tokenized)
    labels = np.asarray(labels)
    label_dtype = objective.label_dtype
    if objective.per_token != (packed.labels is not None):
        raise ValueError(f"the {objective.name} objective needs per-token labels exactly when "
                         "it is a token task; tokenise with labels (or drop them)")
    if np.issubdtype(label_dtype, np.integer) and not np.issubdtype(labels.dtype, np.integer):
        if np.any(labels != np.round(labels)):
            raise ValueError("class labels must be integers; pass objective=REGRESSION for scores")
    clients = [np.asarray(ix, dtype=np.int64).reshape(-1) for ix in client_indices]
    seeds = _seed_list(seed)
    ids = list(range(len(clients))) if client_ids is None else [int(c) for c in client_ids]
    if len(ids) != len(clients):
        raise ValueError("client_ids and client_indices differ in length")
    width = lambda longest: _width(longest, pad_to_multiple, max_length)  # noqa: E731
    if packing:
        if pack_width < 1:
            raise ValueError("pack_width must be >= 1")
        # W from the whole pool, not this round's clients, so shapes recur from round to round
        row_width = max(pack_width, width(int(packed.lengths.max(initial=1))))

    # per client, per epoch: batches of pool indices
    per_client: list[list[list[np.ndarray]]] = []
    for i, ix in enumerate(clients):
        lens = packed.lengths[ix]
        epochs_i = []
        for e in range(epochs):
            rng = np.random.default_rng([*seeds, _TAG_CLIENT, ids[i], e]) if shuffle else None
            win = window if bucketing and not packing else None
            epochs_i.append([ix[b] for b in _epoch_batches(lens, batch_size, rng, win)])
        per_client.append(epochs_i)

    # A batch's cost: its longest example (T), or packed, its real tokens (the stream's N).
    def longest(batch: np.ndarray) -> int:
        return int(packed.lengths[batch].sum() if packing else packed.lengths[batch].max())

    size = (lambda n: _ladder(n, pad_to_multiple)) if packing else width  # noqa: E731

    def attention_rows(batches: Any, tokens: int) -> int:
        """Packed: rows for a bucket of `tokens` stream positions: one more than the tokens need
        (first-fit rarely needs more), so R follows N and shapes recur; more if a batch needs."""
        if not packing:
            return 0
        needed = max((_first_fit(packed.lengths[b], row_width)[2] for b in batches), default=1)
        return max(needed, -(-tokens // row_width) + 1)

    def assemble(rows: np.ndarray, steps: np.ndarray, t: int, num_rows: int) -> Segment:
        if not packing:
            return _assemble(packed, rows, steps, labels, t, label_dtype, pad_id)
        return _assemble_packed(
            packed, rows, steps, labels, t, num_rows, row_width, label_dtype, pad_id
        )

    if not bucketing:
        flat = [[b for ep in c for b in ep] for c in per_client]
        rows, steps = _stack(flat, batch_size)
        top = max((longest(b) for c in flat for b in c), default=1)
        n = size(top)
        return [assemble(rows, steps, n, attention_rows([b for c in flat for b in c], n))]

    num_batches = np.array([len(c[0]) for c in per_client], dtype=np.int64)
    grid = _GRID
    pos = _cut_positions(num_batches, grid)
    # rank batches by length within each (client, epoch); ties broken by the shuffled order
    ranked = [
        [sorted(ep, key=longest) for ep in c]  # sorted() is stable
        for c in per_client
    ]
    sorted_len = [
        np.array([[longest(b) for b in ep] for ep in c]).reshape(epochs, -1) for c in ranked
    ]
    sorted_max = np.zeros_like(pos)
    for i, sl in enumerate(sorted_len):
        if sl.shape[1]:
            cummax = np.maximum.accumulate(sl.max(axis=0))
            sorted_max[i] = np.where(pos[i] > 0, cummax[np.maximum(pos[i] - 1, 0)], 0)
    cuts = _choose_cuts(sorted_max, pos, num_buckets, size)
    buckets = list(zip(cuts[:-1], cuts[1:], strict=True))

    # one (S, T) per bucket, shared by all epochs
    shapes = []
    for a, b in buckets:
        count = pos[:, b] - pos[:, a]
        top = int(np.max(np.where(count > 0, sorted_max[:, b], 0))) if np.any(count > 0) else 1
        members = [x for i, c in enumerate(ranked) for ep in c for x in ep[pos[i, a] : pos[i, b]]]
        shapes.append((int(count.max()), size(top), attention_rows(members, size(top))))

    segments = []
    for e in range(epochs):
        order = (
            np.random.default_rng([*seeds, _TAG_ORDER, e]).permutation(len(buckets))
            if shuffle
            else np.arange(len(buckets))
        )
        for g in order:
            a, b = buckets[g]
            s, t, num_rows = shapes[g]
            if s == 0:
                continue
            chosen = []
            for i in range(len(clients)):
                part = ranked[i][e][pos[i, a] : pos[i, b]]
                if shuffle and part:
                    rng = np.random.default_rng([*seeds, _TAG_CLIENT, ids[i], e, 1 + int(g)])
                    part = [part[j] for j in rng.permutation(len(part))]
                chosen.append(part)
            rows, steps = _stack(chosen, batch_size)
            if rows.shape[1] < s:  # a bucket keeps its S in every epoch
                rows = np.pad(rows, ((0, 0), (0, s - rows.shape[1]), (0, 0)), constant_values=-1)
                steps = np.pad(steps, ((0, 0), (0, s - steps.shape[1])))
            segments.append(assemble(rows, steps, t, num_rows))
    return segments


def make_client_batches(
    tokenized: Any,
    client_indices: Sequence[np.ndarray],
    labels: np.ndarray,
    *,
    batch_size: int,
    epochs: int,
    seed: int | Sequence[int],
    shuffle: bool = True,
    pad_to_multiple: int = 8,
    objective: Classification = CLASSIFICATION,
    bucketing: bool = True,
    num_buckets: int = 8,
    window: int = 200,
    max_length: int | None = None,
    pad_id: int = 0,
    client_ids: Sequence[int] | None = None,
    packing: bool = False,
    pack_width: int = 64,
) -> list[Segment]:
    """Training segments for the clients `client_indices` (pool indices into `tokenized`/`labels`).

    Client i has epochs * ceil(n_i / B) real steps; shorter clients get masked (step_mask False)
    steps. `seed` (an int or a sequence such as [seed, round]) fixes every random choice;
    `client_ids` (default: positions 0..K-1) key each client's shuffles, so a client sampled into
    a different position of a round gets the same order. Pass `pack(tokenized)` once instead of
    `tokenized` to avoid re-flattening the ragged tokens every round.

    `packing=True` lays each batch's examples end to end in one token stream, with attention
    rows of `pack_width` slots (wider if the pool's longest example is longer) filled first-fit
    decreasing (see the module docstring); batches are then plain shuffled batches, bucketed by
    their real tokens.
    """
    return _build(
        tokenized, client_indices, labels, batch_size=batch_size, epochs=epochs, seed=seed,
        shuffle=shuffle, pad_to_multiple=pad_to_multiple, objective=objective,
        bucketing=bucketing, num_buckets=num_buckets, window=window, max_length=max_length,
        pad_id=pad_id, client_ids=client_ids, packing=packing, pack_width=pack_width,
    )  # fmt: skip


def make_eval_batches(
    tokenized: Any,
    client_indices: Sequence[np.ndarray],
    labels: np.ndarray,
    *,
    batch_size: int,
    pad_to_multiple: int = 8,
    objective: Classification = CLASSIFICATION,
    bucketing: bool = True,
    num_buckets: int = 8,
    max_length: int | None = None,
    pad_id: int = 0,
) -> list[Segment]:
    """Evaluation segments: one epoch, no shuffling (with bucketing: examples sorted by length).

    Map predictions back with `example_index` (rows with example_mask 0 are padding).
    """
    window = max(1, max((np.asarray(ix).size for ix in client_indices), default=1))
    return _build(
        tokenized, client_indices, labels, batch_size=batch_size, epochs=1, seed=0,
        shuffle=False, pad_to_multiple=pad_to_multiple, objective=objective,
        bucketing=bucketing, num_buckets=num_buckets, window=window, max_length=max_length,
        pad_id=pad_id,
    )  # fmt: skip


def packed_shape(segment: Segment) -> tuple[int, int, int] | None:
    """(S, N, R) of a packed segment (steps, stream tokens, attention rows); None if padded."""
    if not segment.packed:
        return None
    return (
        segment.input_ids.shape[1],
        segment.input_ids.shape[2],
        segment.attention_mask.shape[2],
    )


def client_segments(segments: Sequence[Segment]) -> list[list[Segment | None]]:
    """Each client's part of each stacked segment ([segment][client]), as a segment of one
    client ([1, S, ...]), or None where the client has no real step in it.

    A stacked segment has one shape for all its clients, so each computes the padding that the
    client with the most tokens needed. A client trained alone need not: its packed part is cut
    to the smallest packed shape among `segments` (same S) that holds its tokens and attention
    rows, so it computes less padding and nothing new is compiled. The real tokens, their slots
    and every example's first position stay where they were (rows fill from the first), so the
    model computes the same real outputs (and `model.dropout` the same masks). Padded parts keep
    their shape (their dropout masks would move with T).
    """
    shapes = {packed_shape(s) for s in segments} - {None}
    return [
        [_client_part(seg, i, shapes) for i in range(len(seg.step_mask))] for seg in segments
    ]


def _client_part(segment: Segment, i: int, shapes: set) -> Segment | None:
    steps = np.asarray(segment.step_mask[i]) & (np.asarray(segment.example_mask[i]).sum(-1) > 0)
    if not steps.any():
        return None
    own = jax.tree.map(lambda value: np.asarray(value[i : i + 1]), segment)
    shape = packed_shape(own)
    if shape is None:
        return own
    slots = own.attention_mask[0][steps] > 0  # [real steps, R, W]
    tokens = int(slots.sum(axis=(1, 2)).max())
    used = int(slots.any(axis=2).sum(axis=1).max())  # first-fit fills rows 0, 1, ...
    fits = [(n, r) for s, n, r in shapes if s == shape[0] and n >= tokens and r >= used]
    n, rows = min(fits, default=shape[1:])
    stream = ["input_ids", "token_type_ids", "position_ids", "token_slots"]
    if own.labels.shape == own.input_ids.shape:  # a token task's labels follow the stream
        stream.append("labels")
    cut = {key: getattr(own, key)[..., :n] for key in stream}
    cut.update({key: getattr(own, key)[..., :rows, :] for key in ("row_tokens", "attention_mask")})
    return own.replace(**cut)


def padding_waste(segments: Sequence[Segment], skip_masked_steps: bool = False) -> float:
    """Fraction of computed token positions that are padding.

    Padding rows and positions always count as computed; masked steps (step_mask False) too,
    unless `skip_masked_steps` (clients run one at a time, `chunk_size=1`, where `lax.cond`
    skips them). Packed segments count their token stream (what the token-wise layers compute);
    empty attention slots are not counted (attention is a small share of the FLOPs, see flops).
    """
    computed = 0
    real = 0
    for seg in segments:
        steps = np.asarray(seg.step_mask)
        per_step = int(np.prod(seg.input_ids.shape[2:]))
        computed += (int(steps.sum()) if skip_masked_steps else steps.size) * per_step
        if seg.packed:  # packed: example numbers, 0 = padding
            tokens = np.asarray(seg.attention_mask) > 0
        else:
            tokens = seg.attention_mask * seg.example_mask[..., None].astype(np.int64)
        real += int(np.sum(tokens * steps.reshape(steps.shape + (1,) * (tokens.ndim - 2))))
    return 0.0 if computed == 0 else 1.0 - real / computed
