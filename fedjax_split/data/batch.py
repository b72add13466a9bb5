"""The typed batch: what a client step and an evaluation step read, as one pytree.

A `Batch` holds padded examples, a `PackedBatch` a token stream (examples end to end, see
`batching`). The same types serve at every level: one batch ([B, ...]), one client's segment of S
steps ([S, B, ...]) and a round's segment of K clients ([K, S, B, ...]); `jax.tree.map`, `vmap`
and `lax.scan` slice them like any pytree. The kind of a batch is its type, never guessed from
which keys a dict happens to hold.

Fields that a consumer does not need are None (an empty pytree node): `for_training` drops
`example_index`, `model_inputs` keeps only what the model reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax
from flax import struct

Array = Any  # numpy or jax array


@struct.dataclass(kw_only=True)
class Batch:
    """Padded examples. Shapes for one batch; segments add leading [S] or [K, S] axes."""

    input_ids: Array  # int32 [B, T]
    attention_mask: Array  # int32 [B, T]: 1 real token, 0 padding
    token_type_ids: Array  # int32 [B, T]
    labels: Array | None = None  # [B] int32 (float32 for regression); a token task's [B, T]
    example_mask: Array | None = None  # float32 [B]: 1 real example, 0 padding row
    step_mask: Array | None = None  # bool []: False = a padded step (the client stays unchanged)
    example_index: Array | None = None  # int32 [B]: pool index of each row, -1 for padding
    # bool []: this part ends its step, the client updates after it (a packed step of more
    # tokens than one part holds spans several parts: `batching`); None: every batch is a step
    last_part: Array | None = None

    packed: ClassVar[bool] = False

    def layout(self) -> dict[str, Array]:
        """The packed layout's keyword arguments for the model's apply (none when padded)."""
        return {}

    def for_training(self) -> Batch:
        """The batch without `example_index` (which only evaluation reads)."""
        return self.replace(example_index=None)

    def model_inputs(self) -> Batch:
        """Only what the model reads: tokens and layout (labels and masks None)."""
        return self.replace(labels=None, example_mask=None, step_mask=None, example_index=None,
                            last_part=None)


@struct.dataclass(kw_only=True)
class PackedBatch(Batch):
    """Examples end to end in one token stream of N positions, attention on R rows of W slots.

    input_ids / token_type_ids / position_ids / token_slots [N]; attention_mask (each slot's batch
    slot + 1, 0 = empty) and row_tokens (each slot's stream position) [R, W]; cls_index [B] each
    example's first stream position (`models.attention.Layout`). A token task's labels follow the
    stream ([N]).
    """

    position_ids: Array
    row_tokens: Array
    token_slots: Array
    cls_index: Array

    packed: ClassVar[bool] = True

    def layout(self) -> dict[str, Array]:
        return {
            "position_ids": self.position_ids,
            "row_tokens": self.row_tokens,
            "token_slots": self.token_slots,
            "cls_index": self.cls_index,
        }


def apply_batch(
    apply: Callable[..., jax.Array], params: Any, batch: Batch, **kwargs: Any
) -> jax.Array:
    """The model's logits for one batch (padded or packed); kwargs: train, rng."""
    return apply(
        params,
        batch.input_ids,
        batch.attention_mask,
        batch.token_type_ids,
        **kwargs,
        **batch.layout(),
    )


def num_clients(segment: Batch) -> int:
    """K of a round's segment [K, S, ...]."""
    return int(segment.step_mask.shape[0])
