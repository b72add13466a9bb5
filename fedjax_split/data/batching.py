"""Each client's mini-batches, built from its own examples alone, in the run's one shape.

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
row, -1 for padding; evaluation maps predictions back with it). `make_client_batches` stacks
several clients' steps for the vmapped round (`data.stacking`).

Mini-batches (Algorithm 1): each epoch the client's examples are shuffled and cut into batches of
B (the last one partial); every example is seen once per epoch. Across epochs and clients, pairs
of examples meet in a batch no more often than chance. `bucketing=True` (an option, not the
default) instead sorts each window of `window` batches by length before cutting, so a batch holds
examples of similar length (less padding without packing), and visits the epoch's batches in a
random order; its batches repeat their membership from epoch to epoch far more than chance, and
where length correlates with the label, so do the labels in a batch.

Shapes: one per run for training and one for evaluation, whatever the clients, rounds and data
sizes, so that the client's program and the evaluation program each compile once (the paper pads
every input to 128 tokens; t5x/seqio and MaxText fix their shapes likewise). Padded: [B, T] with T =
`row_width`, run-wide (the pool's longest example rounded up, or --max-length's bound for sites
without a pool). Packed (`packing=True`, the default; `data.packing`): parts of N stream tokens
(`part_tokens`), R attention rows of W slots and B example slots; a step of more tokens than a
part holds spans several (`last_part` marks its end), so a step is still one update on its B
examples. N is run-wide too: by default the mean batch's tokens plus 2.5 standard deviations
(`default_part_tokens`: one part for all but about one step in a hundred). An epoch's last,
partial batch is masked rows of the same shape. Padding rows (example_mask 0) of padded batches get
input_ids = pad_id and attend to position 0 only, so a model never sees an all-masked attention row
(which could produce NaN that a zero weight cannot cancel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fedjax_split.data.batch import Batch
from fedjax_split.data.flat_tokens import Packed, pack
from fedjax_split.data.packing import (
    assemble_packed,
    eval_part_members,
    part_members,
    rows_per_part,
)
from fedjax_split.data.stacking import stack_clients
from fedjax_split.tasks.objectives import CLASSIFICATION, IGNORE, Classification

_TAG_CLIENT = 0x63_6C_69  # "cli"
PACK_WIDTH = 64  # the narrowest attention row of packed batches


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


def _check_labels(packed: Packed, labels: np.ndarray, objective: Classification) -> None:
    if objective.per_token != (packed.labels is not None):
        raise ValueError(
            f"the {objective.name} objective needs per-token labels exactly when "
            "it is a token task; tokenise with labels (or drop them)"
        )
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


def _part(packed: Packed, slots: np.ndarray, labels: np.ndarray, sh: Batching, last: bool) -> Batch:
    """One part [1, B, ...]: pool indices `slots` [B] (-1: not in this part) in the run's one
    shape; `last`: the part that ends its step (the client updates after it)."""
    rows = slots.reshape(1, 1, -1)
    real_step = np.array([[True]])
    dtype = sh.objective.label_dtype
    if not sh.packing:
        out = _assemble(packed, rows, real_step, labels, sh.row_width, dtype, sh.pad_id)
    else:
        num_rows = rows_per_part(sh.part_tokens, sh.row_width)
        out = assemble_packed(packed, rows, real_step, labels, sh.part_tokens, num_rows,
                              sh.row_width, dtype, sh.pad_id)  # fmt: skip
    out = jax.tree.map(lambda x: x[0], out)  # drop the client axis of 1
    return out.replace(last_part=np.array([last]))


def _step_parts(packed: Packed, batch: np.ndarray, labels: np.ndarray, sh: Batching
                ) -> list[Batch]:  # fmt: skip
    """One step of the pool indices `batch` (at most B, each in its batch slot) as its parts:
    one padded part, or as many packed parts as its tokens need."""
    members = [np.arange(batch.size)]
    if sh.packing:
        members = part_members(packed.lengths[batch], sh.part_tokens, sh.row_width)
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
    windows, see the module docstring). Pass `flat_tokens.pack(tokenized)` to avoid re-flattening
    the ragged tokens every round, and `how.row_width` / `how.part_tokens` (`resolved` on the
    whole pool) when `tokenized` is not the pool every client shares.
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
        groups = eval_part_members(packed.lengths[ix], sh.batch_size, sh.part_tokens, sh.row_width)
    else:
        groups = [np.arange(i, min(i + sh.batch_size, ix.size))
                  for i in range(0, ix.size, sh.batch_size)]  # fmt: skip
    out = []
    for g in groups:
        slots = np.full(sh.batch_size, -1, np.int64)
        slots[: g.size] = ix[g]
        out.append(_part(packed, slots, labels, sh, last=True))
    return out


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
        per_step = int(np.prod(seg.input_ids.shape[steps.ndim :]))
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
