"""Several clients' steps stacked on a leading client axis K for the vmapped round.

`stack_clients` gives step j of every client one shape [K, 1, ...]: each client's step is grown
to the widest among them (T of padded batches; N and R of packed ones) with padding that computes
nothing real, and a client with fewer steps gets masked steps (step_mask False), which leave it
exactly unchanged. A packed client trains bit for bit the same model alone or stacked (see
`data.packing`); a padded batch stacked with wider clients grows T, which moves its dropout masks
(the same distribution, other draws).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fedjax_split.data.batch import Batch
from fedjax_split.tasks.objectives import IGNORE


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
