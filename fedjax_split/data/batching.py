"""Each client's mini-batches, built from its own examples alone, and their stacking for vmap.

A client's batches for a round are a pure function of its examples, the seed (e.g. [seed, round]),
its client id, the epochs and the run-wide settings (`Batching`: batch size, packing, max length,
row width, ...): never of the other clients' data. So a client in a real federation
(`fedjax_split.deploy`) builds exactly the batches the simulation builds for it, and the
simulation can hold only the sampled clients'.

`client_batches` gives one client's steps in order: E epochs of mini-batches, each step a typed
batch (`data.batch.Batch`, or `PackedBatch` with packing) with a leading step axis of 1:
input_ids / attention_mask / token_type_ids int32 [1, B, T], labels [1, B] (int32, float32 for
regression; a token task's int32 [1, B, T], IGNORE where no label is: see tasks.objectives),
example_mask float32 [1, B], step_mask bool [1], example_index int32 [1, B] (pool index of each
row, -1 for padding; evaluation maps predictions back with it). `stack_clients` stacks several
clients' steps on a leading client axis K for the vmapped round ([K, 1, ...] per step), padding
shapes to the widest client and giving clients with fewer steps masked steps (step_mask False).

Mini-batches (Algorithm 1): each epoch the client's examples are shuffled and cut into batches of
B (the last one partial); every example is seen once per epoch. Across epochs and clients, pairs
of examples meet in a batch no more often than chance. `bucketing=True` (an option, not the
default) instead sorts each window of `window` batches by length before cutting, so a batch holds
examples of similar length (less padding without packing), and visits the epoch's batches in a
random order; its batches repeat their membership from epoch to epoch far more than chance, and
where length correlates with the label, so do the labels in a batch.

Packing (`packing=True`, the default) lays a step's examples end to end in one token stream
input_ids / token_type_ids / position_ids [1, N] that every token-wise layer computes, so padding
costs nothing whatever the batch's mix of lengths. Attention runs on R rows of W slots
([1, R, W]: attention_mask = batch slot + 1 or 0, row_tokens = stream position), filled first-fit
decreasing; token_slots [1, N] and cls_index [1, B] map back (`models.bert.Layout`). A token
task's labels follow the stream ([1, N]).

Shapes: a step's size (T padded, N packed) is its longest example (padded) or its real tokens
(packed) rounded up to a ladder of `steps_per_octave` sizes per power of two (multiples of
`pad_to_multiple`), so that the same few shapes recur in every round and compile once. W is
run-wide (`row_width`, default from the pool's longest example), R follows N (a batch that needs
more rows takes a larger N), and N is at least B W / 4, so that an epoch's last, partial batch
does not add a small shape per client (docs/benchmarks.md counts the shapes and the padding of a
run). Padding rows (example_mask 0) of padded batches get input_ids = pad_id and attend to
position 0 only, so a model never sees an all-masked attention row (which could produce NaN that a
zero weight cannot cancel).

Dropout (`models.bert.dropout`) draws each element's mask from its flat index, so growing a
leading axis (a packed stream's tokens, attention rows) when clients are stacked leaves every
real token's masks as they were: a packed client trains bit for bit the same model alone or
stacked. A padded batch stacked with wider clients grows T, which moves its masks (the same
distribution, other draws).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from fedjax_split.data.batch import Batch, PackedBatch
from fedjax_split.tasks.objectives import CLASSIFICATION, IGNORE, Classification

_TAG_CLIENT = 0x63_6C_69  # "cli"
PACK_WIDTH = 64  # the narrowest attention row of packed batches


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


def _ladder(n: int, multiple: int, steps_per_octave: int) -> int:
    """n rounded up to a multiple of `multiple` and to one of `steps_per_octave` points per power
    of two (at most 1/steps_per_octave of the size apart): step sizes vary with every batch, and
    a ladder makes their shapes, hence compilations, recur."""
    n = max(int(n), 1)
    step = max(multiple, 2 ** (n.bit_length() - 1) // steps_per_octave)
    return _round_up(n, step)


def _width(longest: int, multiple: int, steps_per_octave: int, max_length: int | None) -> int:
    """T of a padded step: its longest example on the ladder, not past max_length (the examples
    are already truncated to it, so the cap never cuts a token)."""
    t = _ladder(longest, multiple, steps_per_octave)
    if max_length is not None:
        t = min(t, max(max_length, longest))
    return t


def default_row_width(tokenized: Any, pack_width: int = PACK_WIDTH, multiple: int = 8) -> int:
    """W of packed attention rows for a pool: `pack_width`, or its longest example rounded up.

    A run-wide constant (every client of the pool gets the same W, so shapes recur): pass it as
    `Batching.row_width` when a client holds only part of the pool."""
    longest = int(pack(tokenized).lengths.max(initial=1))
    return max(pack_width, _round_up(longest, multiple))


def row_width_for(max_length: int, pack_width: int = PACK_WIDTH, multiple: int = 8) -> int:
    """W of packed attention rows for examples of at most `max_length` tokens (truncation's
    bound): what a client that sees no pool takes, the same for every client of a run."""
    return max(pack_width, _round_up(int(max_length), multiple))


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


def _assemble(
    packed: Packed,
    rows: np.ndarray,
    steps_real: np.ndarray,
    labels: np.ndarray,
    width: int,
    label_dtype: Any,
    pad_id: int,
) -> Batch:
    """Gathers a batch from pool indices `rows` [K, S, B] (-1 = padding). A token task's
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


def _check_labels(packed: Packed, labels: np.ndarray, objective: Classification) -> None:
    if objective.per_token != (packed.labels is not None):
        raise ValueError(f"the {objective.name} objective needs per-token labels exactly when "
                         "it is a token task; tokenise with labels (or drop them)")
    if np.issubdtype(objective.label_dtype, np.integer) and not np.issubdtype(
        labels.dtype, np.integer
    ):
        if np.any(labels != np.round(labels)):
            raise ValueError("class labels must be integers; pass objective=REGRESSION for scores")


@dataclasses.dataclass(frozen=True)
class Batching:
    """How a client cuts its examples into steps; the same for every client of a run.

    Run-wide and static, so that every client (simulated or federated) builds its steps alike and
    their shapes recur. `batch_size` B; `objective` (label dtype, per-token labels); `packing`
    (token streams, else padded rows); `bucketing` with `window` (length-sorted windows, training
    only); `shuffle` (training only); `pad_to_multiple` and `steps_per_octave` (the shape
    ladder); `max_length` (cap of padded T); `row_width` (packed W, None: the longest example of
    the `tokenized` passed, so pass the pool's when a client holds only part of it); `pad_id`.
    """

    batch_size: int
    objective: Classification = CLASSIFICATION
    packing: bool = True
    bucketing: bool = False
    window: int = 200
    shuffle: bool = True
    pad_to_multiple: int = 8
    steps_per_octave: int = 4
    max_length: int | None = None
    row_width: int | None = None
    pad_id: int = 0


def _resolve(packed: Packed, how: Batching) -> Batching:
    """`how` checked, with a packed run's `row_width` filled in from `packed` when unset."""
    if how.batch_size < 1 or how.pad_to_multiple < 1 or how.steps_per_octave < 1:
        raise ValueError("batch_size, pad_to_multiple and steps_per_octave must be >= 1")
    if how.packing and how.row_width is None:
        return dataclasses.replace(
            how, row_width=default_row_width(packed, multiple=how.pad_to_multiple)
        )
    return how


def _prepare(
    tokenized: Any, indices: np.ndarray, labels: np.ndarray, how: Batching
) -> tuple[Packed, np.ndarray, np.ndarray, Batching]:
    """What client_batches and client_eval_batches start from: the flat tokens, the labels
    (checked against the objective), the client's pool indices and the resolved settings."""
    packed = pack(tokenized)
    labels = np.asarray(labels)
    _check_labels(packed, labels, how.objective)
    ix = np.asarray(indices, dtype=np.int64).reshape(-1)
    return packed, labels, ix, _resolve(packed, how)


def _step(packed: Packed, batch: np.ndarray, labels: np.ndarray, sh: Batching) -> Batch:
    """One step [1, B, ...] of the pool indices `batch` (at most B; the rest are padding rows);
    `sh` is resolved (`_resolve`: a packed run's row_width set)."""
    rows = np.full((1, 1, sh.batch_size), -1, np.int64)
    rows[0, 0, : batch.size] = batch
    real_step = np.array([[batch.size > 0]])
    lengths = packed.lengths[batch]
    dtype = sh.objective.label_dtype
    if not sh.packing:
        longest = int(lengths.max(initial=1))
        t = _width(longest, sh.pad_to_multiple, sh.steps_per_octave, sh.max_length)
        out = _assemble(packed, rows, real_step, labels, t, dtype, sh.pad_id)
    else:
        if lengths.size and lengths.max() > sh.row_width:
            raise ValueError(f"an example of {int(lengths.max())} tokens does not fit attention "
                             f"rows of {sh.row_width} slots; pass a wider row_width")
        # R follows N (one row more than the tokens need), so the shape is N's alone and recurs;
        # a batch whose first-fit needs more rows takes the next N up the ladder
        needed = _first_fit(lengths, sh.row_width)[2] if lengths.size else 1
        # at least a quarter of B full rows: an epoch's last, partial batch would otherwise add
        # a small shape of its own for every client and round
        floor = sh.batch_size * sh.row_width // 4
        n = _ladder(max(int(lengths.sum()), floor), sh.pad_to_multiple, sh.steps_per_octave)
        while -(-n // sh.row_width) + 1 < needed:
            n = _ladder(n + 1, sh.pad_to_multiple, sh.steps_per_octave)
        r = -(-n // sh.row_width) + 1
        out = _assemble_packed(packed, rows, real_step, labels, n, r, sh.row_width, dtype,
                               sh.pad_id)  # fmt: skip
    return jax.tree.map(lambda x: x[0], out)  # drop the client axis of 1


def client_batches(
    tokenized: Any,
    indices: np.ndarray,
    labels: np.ndarray,
    how: Batching,
    *,
    epochs: int,
    seed: int | Sequence[int],
    client_id: int = 0,
) -> list[Batch]:
    """One client's training steps for a round, in order, each a batch [1, B, ...].

    `indices` are the client's examples (pool indices into `tokenized` / `labels`); `seed` (an int
    or a sequence such as [seed, round]) and `client_id` fix every random choice, so the result
    depends on nothing but this client's examples and the run-wide `how`. E epochs of
    ceil(n / B) steps; each epoch shuffles the examples afresh (`how.bucketing`: sorted in
    windows, see the module docstring). Pass `pack(tokenized)` to avoid re-flattening the ragged
    tokens every round, and `how.row_width` (`default_row_width` of the whole pool) when
    `tokenized` is not the pool every client shares.
    """
    if epochs < 1:
        raise ValueError("epochs must be >= 1")
    packed, labels, ix, sh = _prepare(tokenized, indices, labels, how)
    seeds = _seed_list(seed)
    window = sh.window if sh.bucketing else None
    steps = []
    for e in range(epochs):
        key = [*seeds, _TAG_CLIENT, int(client_id), e]
        rng = np.random.default_rng(key) if sh.shuffle else None
        batches = _epoch_batches(packed.lengths[ix], sh.batch_size, rng, window)
        if sh.bucketing and rng is not None:  # similar lengths in a batch, the batches in any order
            batches = [batches[j] for j in rng.permutation(len(batches))]
        steps.extend(_step(packed, ix[b], labels, sh) for b in batches)
    return steps


def client_eval_batches(
    tokenized: Any, indices: np.ndarray, labels: np.ndarray, how: Batching
) -> list[Batch]:
    """One client's test examples once each, as batches [1, B, ...]; padded batches take them
    sorted by length (similar lengths share a batch and a shape), packed ones in order (a full
    packed batch's stream then holds about B times the mean length: one or two shapes, where
    sorted batches would climb the ladder). Map predictions back with `example_index`.
    Each example is seen once, in this fixed order: `how`'s bucketing, window and shuffle are
    not used."""
    packed, labels, ix, sh = _prepare(tokenized, indices, labels, how)
    if not sh.packing:
        ix = ix[np.argsort(packed.lengths[ix], kind="stable")]
    b = sh.batch_size
    return [_step(packed, ix[i : i + b], labels, sh) for i in range(0, ix.size, b)]


def _size(batch: Batch) -> tuple[int, int]:
    """(T, 0) of a padded step, (N, R) of a packed one: what stacking may grow."""
    rows = batch.attention_mask.shape[-2] if batch.packed else 0
    return batch.input_ids.shape[-1], rows


def _grow(x: np.ndarray, axis: int, size: int, fill: Any) -> np.ndarray:
    """`x` padded with `fill` at the end of `axis` up to `size`."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return np.pad(x, pad, constant_values=fill)


def _pad_to(batch: Batch, size: tuple[int, int], pad_id: int) -> Batch:
    """`batch` grown to `size` (`_size`): T padded, or N and R packed. What is added is padding
    (pad ids, no attention, IGNORE labels), so the real tokens compute as before."""
    length, rows = size
    stream = ["input_ids", "token_type_ids"] + (["position_ids", "token_slots"] * batch.packed)
    if batch.labels.shape == batch.input_ids.shape:  # a token task's labels follow the tokens
        stream.append("labels")
    fill = {"input_ids": pad_id, "labels": IGNORE}
    grown = {name: _grow(getattr(batch, name), -1, length, fill.get(name, 0)) for name in stream}
    if batch.packed:
        grown.update({name: _grow(getattr(batch, name), -2, rows, 0)
                      for name in ("attention_mask", "row_tokens")})  # fmt: skip
    else:
        grown["attention_mask"] = _grow(batch.attention_mask, -1, length, 0)
    return batch.replace(**grown)


def _masked_like(batch: Batch) -> Batch:
    """A step with no real example, of `batch`'s shape and kind (for a client with fewer steps):
    zeros, IGNORE labels where per token, example_index -1; padded rows attend to position 0."""
    token_labels = batch.labels.shape == batch.input_ids.shape
    out = jax.tree.map(np.zeros_like, batch).replace(
        example_index=np.full_like(batch.example_index, -1),
        labels=np.full_like(batch.labels, IGNORE) if token_labels else np.zeros_like(batch.labels),
    )
    if not batch.packed:
        out.attention_mask[..., 0] = 1
    return out


def stack_clients(per_client: Sequence[Sequence[Batch]], pad_id: int = 0) -> list[Batch]:
    """Several clients' steps on a leading client axis: one stacked batch [K, 1, ...] per step.

    Step j holds every client's j-th step, each grown to the widest among them (`_pad_to`); a
    client with fewer steps gets masked steps (step_mask False), which leave it exactly
    unchanged. The clients' batches must be of one kind (padded or packed), batch size and row
    width: built with the same settings.
    """
    if not per_client:
        raise ValueError("no clients")
    stacked = []
    for j in range(max(len(c) for c in per_client)):
        present = [c[j] for c in per_client if j < len(c)]
        if len({type(b) for b in present}) != 1:
            raise ValueError("the clients' batches mix padded and packed ones; build them alike")
        size = tuple(max(x) for x in zip(*(_size(b) for b in present), strict=True))
        blank = _masked_like(present[0])
        rows = [_pad_to(c[j] if j < len(c) else blank, size, pad_id) for c in per_client]
        stacked.append(jax.tree.map(lambda *x: np.stack(x), *rows))
    return stacked


def make_client_batches(
    tokenized: Any,
    client_indices: Sequence[np.ndarray],
    labels: np.ndarray,
    how: Batching,
    *,
    epochs: int,
    seed: int | Sequence[int],
    client_ids: Sequence[int] | None = None,
) -> list[Batch]:
    """`client_batches` of several clients (client i keyed by `client_ids[i]`, default i),
    stacked (`stack_clients`): one batch [K, 1, ...] per step. A packed run's unset row_width
    comes from the whole `tokenized`, so every client gets the same W."""
    if len(client_indices) == 0:
        raise ValueError("no clients")
    ids = list(range(len(client_indices))) if client_ids is None else [int(c) for c in client_ids]
    if len(ids) != len(client_indices):
        raise ValueError("client_ids and client_indices differ in length")
    packed = pack(tokenized)
    how = _resolve(packed, how)  # W of the whole pool, once
    per_client = [
        client_batches(packed, ix, labels, how, epochs=epochs, seed=seed, client_id=cid)
        for ix, cid in zip(client_indices, ids, strict=True)
    ]
    return stack_clients(per_client, how.pad_id)


def padding_waste(segments: Sequence[Batch], skip_masked_steps: bool = False) -> float:
    """Fraction of computed token positions that are padding, over batches of any leading axes
    (one client's steps [S, ...] or stacked ones [K, S, ...]).

    Padding rows and positions always count as computed; masked steps (step_mask False) too,
    unless `skip_masked_steps` (clients trained one at a time skip them). Packed batches count
    their token stream (what the token-wise layers compute); empty attention slots are not
    counted (attention is a small share of the FLOPs, see flops).
    """
    computed = 0
    real = 0
    for seg in segments:
        steps = np.asarray(seg.step_mask)
        per_step = int(np.prod(seg.input_ids.shape[steps.ndim:]))
        computed += (int(steps.sum()) if skip_masked_steps else steps.size) * per_step
        if seg.packed:  # example numbers, 0 = an empty slot
            tokens = np.asarray(seg.attention_mask) > 0
        else:
            tokens = seg.attention_mask * seg.example_mask[..., None].astype(np.int64)
        real += int(np.sum(tokens * steps.reshape(steps.shape + (1,) * (tokens.ndim - steps.ndim))))
    return 0.0 if computed == 0 else 1.0 - real / computed
