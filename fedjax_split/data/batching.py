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

Shapes: one per run for training and one for evaluation, whatever the clients, rounds and data
sizes, so that the client's program and the evaluation program each compile once (the paper pads
every input to 128 tokens; t5x/seqio and MaxText fix their shapes likewise). Padded: [B, T] with T =
`row_width`, run-wide (the pool's longest example rounded up, or --max-length's bound for sites
without a pool). Packed: a step's examples go into one or more *parts* of a fixed shape, N stream
tokens (`part_tokens`), R = ceil(N / W) + 1 attention rows of W slots and B example slots; a step
whose tokens do not fit one part continues in the next (first fit, longest first), and the client
program accumulates the parts' gradients and updates once at the step's last part (`last_part`), so
a step is still one update on its B examples. N is run-wide too: by default the mean batch's tokens
plus 2.5 standard deviations (`default_part_tokens`: one part for all but about one step in a
hundred). An epoch's last, partial batch is masked rows of the same shape. Evaluation parts take the
examples in order, as many as fit. Padding rows (example_mask 0) of padded batches get input_ids =
pad_id and attend to position 0 only, so a model never sees an all-masked attention row (which could
produce NaN that a zero weight cannot cancel).

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


def default_row_width(tokenized: Any, pack_width: int = PACK_WIDTH, multiple: int = 8) -> int:
    """W of packed attention rows (T of padded batches: pass `pack_width=multiple`) for a pool:
    `pack_width`, or its longest example rounded up.

    A run-wide constant (every client of the pool gets the same W, so shapes recur): pass it as
    `Batching.row_width` when a client holds only part of the pool."""
    longest = int(pack(tokenized).lengths.max(initial=1))
    return max(pack_width, _round_up(longest, multiple))


def row_width_for(max_length: int, pack_width: int = PACK_WIDTH, multiple: int = 8) -> int:
    """W of packed attention rows for examples of at most `max_length` tokens (truncation's
    bound): what a client that sees no pool takes, the same for every client of a run."""
    return max(pack_width, _round_up(int(max_length), multiple))


PART_SIGMAS = 2.5  # a part holds the mean batch's tokens plus this many standard deviations


def default_part_tokens(
    lengths: np.ndarray, batch_size: int, row_width: int, multiple: int = 8
) -> int:
    """N of packed parts for a pool of example `lengths`: the tokens of a mean batch of B plus
    2.5 standard deviations of a batch's tokens (sqrt(B) of an example's), rounded up to a
    multiple of 8, at least one row of W and at most B rows (which hold any batch). Random
    batches of B then fit one part but about one in a hundred; one that does not takes two.
    (A larger N pads every step; a smaller one adds a part, mostly empty, to more of them.)"""
    lengths = np.asarray(lengths, np.float64)
    if lengths.size == 0:
        return row_width
    need = batch_size * lengths.mean() + PART_SIGMAS * np.sqrt(batch_size) * lengths.std()
    return int(min(max(_round_up(int(np.ceil(need)), multiple), row_width),
                   batch_size * row_width))  # fmt: skip


def part_tokens_for(batch_size: int, row_width: int) -> int:
    """N of packed parts without a pool (sites with their own data): B half-full rows of W, the
    same at every site of a run."""
    return max(row_width, _round_up(batch_size * row_width // 2, row_width))


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
                raise AssertionError("a batch does not fit the run's packed shape")
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
    all of them have one shape. `batch_size` B; `objective` (label dtype, per-token labels);
    `packing` (token streams in parts, else padded rows); `bucketing` with `window`
    (length-sorted windows, training only); `shuffle` (training only); `pad_to_multiple` (of T,
    W and N); `row_width` (packed W, padded T; None: the longest example of the `tokenized`
    passed, so pass the pool's when a client holds only part of it); `part_tokens` (packed N;
    None: `default_part_tokens` of the `tokenized` passed, likewise); `pad_id`.
    """

    batch_size: int
    objective: Classification = CLASSIFICATION
    packing: bool = True
    bucketing: bool = False
    window: int = 200
    shuffle: bool = True
    pad_to_multiple: int = 8
    row_width: int | None = None
    part_tokens: int | None = None
    pad_id: int = 0


def _resolve(packed: Packed, how: Batching) -> Batching:
    """`how` checked, with W (T) and a packed run's N filled in from `packed` when unset."""
    if how.batch_size < 1 or how.pad_to_multiple < 1:
        raise ValueError("batch_size and pad_to_multiple must be >= 1")
    if how.row_width is None:
        floor = PACK_WIDTH if how.packing else how.pad_to_multiple
        how = dataclasses.replace(
            how, row_width=default_row_width(packed, floor, multiple=how.pad_to_multiple)
        )
    if how.packing and how.part_tokens is None:
        n = default_part_tokens(packed.lengths, how.batch_size, how.row_width,
                                how.pad_to_multiple)  # fmt: skip
        how = dataclasses.replace(how, part_tokens=n)
    if how.packing and how.part_tokens < how.row_width:
        raise ValueError(f"part_tokens {how.part_tokens} is under one row of {how.row_width}")
    return how


def resolved(tokenized: Any, how: Batching) -> Batching:
    """`how` with the shapes a run's batches take (W, N) filled in from the pool `tokenized`."""
    return _resolve(pack(tokenized), how)


def _prepare(
    tokenized: Any, indices: np.ndarray, labels: np.ndarray, how: Batching
) -> tuple[Packed, np.ndarray, np.ndarray, Batching]:
    """What client_batches and client_eval_batches start from: the flat tokens, the labels
    (checked against the objective), the client's pool indices and the resolved settings."""
    packed = pack(tokenized)
    labels = np.asarray(labels)
    _check_labels(packed, labels, how.objective)
    ix = np.asarray(indices, dtype=np.int64).reshape(-1)
    sh = _resolve(packed, how)
    longest = int(packed.lengths[ix].max(initial=0))
    if longest > sh.row_width:
        what = "attention rows of" if sh.packing else "padded rows of"
        raise ValueError(f"an example of {longest} tokens does not fit {what} {sh.row_width} "
                         "slots; pass a wider row_width")  # fmt: skip
    return packed, labels, ix, sh


def _num_rows(sh: Batching) -> int:
    """R of a packed part: the rows N tokens fill, and one more for first fit's gaps."""
    return -(-sh.part_tokens // sh.row_width) + 1


def _fits(free: list[int], used: int, n: int, sh: Batching) -> int | None:
    """The row (first fit) where an example of n tokens goes in a part with rows `free` and
    `used` tokens; len(free) for a new row; None if it does not fit the part."""
    if used + n > sh.part_tokens:
        return None
    row = next((j for j, f in enumerate(free) if f >= n), len(free))
    return row if row < _num_rows(sh) else None


def _parts(lengths: np.ndarray, sh: Batching) -> list[np.ndarray]:
    """A training step's examples (positions into `lengths`) in parts: longest first, each into
    the first part where it fits (first fit over the parts' rows), a new part when none has room.
    Within a part this is `_first_fit`'s own order, so the part assembles as placed."""
    parts: list[tuple[list[int], list[int], list[int]]] = []  # (members, free rows, [tokens])
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        fits = ((p, _fits(p[1], p[2][0], n, sh)) for p in parts)
        part, row = next(((p, r) for p, r in fits if r is not None), (None, 0))
        if part is None:
            part = ([], [], [0])
            parts.append(part)
        members, free, used = part
        if row == len(free):
            free.append(sh.row_width)
        free[row] -= n
        used[0] += n
        members.append(int(i))
    return [np.sort(np.asarray(m, np.int64)) for m, _, _ in parts]


def _eval_parts(lengths: np.ndarray, sh: Batching) -> list[np.ndarray]:
    """Test examples in order, as many as fit each packed part (B slots, N tokens, R rows as
    `_assemble_packed` fills them: first fit, longest first)."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths.tolist()):
        fits = (len(current) < sh.batch_size and used + n <= sh.part_tokens
                and _first_fit(lengths[[*current, i]], sh.row_width)[2] <= _num_rows(sh))
        if current and not fits:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    return [np.asarray(g, np.int64) for g in [*groups, current] if g]


def _part(
    packed: Packed, slots: np.ndarray, labels: np.ndarray, sh: Batching, last: bool
) -> Batch:
    """One part [1, B, ...]: pool indices `slots` [B] (-1: not in this part) in the run's one
    shape; `last`: the part that ends its step (the client updates after it)."""
    rows = slots.reshape(1, 1, -1)
    real_step = np.array([[True]])
    dtype = sh.objective.label_dtype
    if not sh.packing:
        out = _assemble(packed, rows, real_step, labels, sh.row_width, dtype, sh.pad_id)
    else:
        out = _assemble_packed(packed, rows, real_step, labels, sh.part_tokens, _num_rows(sh),
                               sh.row_width, dtype, sh.pad_id)  # fmt: skip
    out = jax.tree.map(lambda x: x[0], out)  # drop the client axis of 1
    return out.replace(last_part=np.array([last]))


def _step_parts(packed: Packed, batch: np.ndarray, labels: np.ndarray, sh: Batching
                ) -> list[Batch]:  # fmt: skip
    """One step of the pool indices `batch` (at most B, each in its batch slot) as its parts:
    one padded part, or as many packed parts as its tokens need."""
    members = [np.arange(batch.size)]
    if sh.packing:
        members = _parts(packed.lengths[batch], sh)
    out = []
    for k, m in enumerate(members):
        slots = np.full(sh.batch_size, -1, np.int64)
        slots[m] = batch[m]
        out.append(_part(packed, slots, labels, sh, last=k == len(members) - 1))
    return out


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
    """One client's training steps for a round, in order, as parts [1, B, ...] of the run's one
    shape (a packed step of more tokens than a part holds spans several: `last_part` marks its
    end).

    `indices` are the client's examples (pool indices into `tokenized` / `labels`); `seed` (an int
    or a sequence such as [seed, round]) and `client_id` fix every random choice, so the result
    depends on nothing but this client's examples and the run-wide `how`. E epochs of
    ceil(n / B) steps; each epoch shuffles the examples afresh (`how.bucketing`: sorted in
    windows, see the module docstring). Pass `pack(tokenized)` to avoid re-flattening the ragged
    tokens every round, and `how.row_width` / `how.part_tokens` (`resolved` on the whole pool)
    when `tokenized` is not the pool every client shares.
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
        for b in batches:
            steps.extend(_step_parts(packed, ix[b], labels, sh))
    return steps


def client_eval_batches(
    tokenized: Any, indices: np.ndarray, labels: np.ndarray, how: Batching
) -> list[Batch]:
    """One client's test examples once each, in order, in batches [1, B, ...] of the run's one
    evaluation shape: padded, B at a time; packed, as many as a part holds (at most B). Map
    predictions back with `example_index`. `how`'s bucketing, window and shuffle are not used."""
    packed, labels, ix, sh = _prepare(tokenized, indices, labels, how)
    if sh.packing:
        groups = _eval_parts(packed.lengths[ix], sh)
    else:
        groups = [np.arange(i, min(i + sh.batch_size, ix.size))
                  for i in range(0, ix.size, sh.batch_size)]  # fmt: skip
    out = []
    for g in groups:
        slots = np.full(sh.batch_size, -1, np.int64)
        slots[: g.size] = ix[g]
        out.append(_part(packed, slots, labels, sh, last=True))
    return out


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


def positions(segments: Sequence[Batch], skip_masked_steps: bool = False) -> tuple[int, int]:
    """(real tokens, computed token positions) over batches of any leading axes (one client's
    steps [S, ...] or stacked ones [K, S, ...]).

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
    return real, computed


def padding_waste(segments: Sequence[Batch], skip_masked_steps: bool = False) -> float:
    """Fraction of computed token positions that are padding (`positions`)."""
    real, computed = positions(segments, skip_masked_steps)
    return 0.0 if computed == 0 else 1.0 - real / computed
