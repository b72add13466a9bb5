"""A pool's tokenised examples flattened into one array: what batching gathers every batch from.

`tokenization.Tokenized` holds ragged lists of per-example arrays; batching reads token j of
example i as `input_ids[offsets[i] + j]`, so a pool is flattened once (`pack`) and every round's
batches gather from the same arrays.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


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
