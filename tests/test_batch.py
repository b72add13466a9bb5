"""The typed batch: a pytree whose kind is its type, views that drop what a consumer does not
read, and one call that runs the model on either kind."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fedcore_helpers import make_segments, tiny_model

from fedjax_split.data.batch import Batch, PackedBatch, apply_batch
from fedjax_split.data.batching import Batching, make_client_batches
from fedjax_split.data.tokenization import Tokenized


def _packed_and_padded() -> tuple[PackedBatch, Batch]:
    """The same five examples as one packed step and one padded step (client and step axes
    dropped)."""
    rng = np.random.default_rng(0)
    lengths = [7, 3, 12, 5, 9]
    ids = [rng.integers(1, 50, n).astype(np.int32) for n in lengths]
    types = [np.zeros(n, np.int32) for n in lengths]
    tok = Tokenized(ids, types, np.asarray(lengths, np.int32))
    common = dict(epochs=1, seed=0)
    packing, padding = Batching(5, shuffle=False), Batching(5, shuffle=False, packing=False)
    (packed,) = make_client_batches(tok, [range(5)], [0, 1, 2, 0, 1], packing, **common)
    (padded,) = make_client_batches(tok, [range(5)], [0, 1, 2, 0, 1], padding, **common)
    one = lambda seg: jax.tree.map(lambda v: v[0, 0], seg)  # noqa: E731
    return one(packed), one(padded)


def test_the_kind_is_the_type_and_tree_maps_keep_it() -> None:
    packed, padded = _packed_and_padded()
    assert type(packed) is PackedBatch and packed.packed
    assert type(padded) is Batch and not padded.packed
    assert set(packed.layout()) == {"position_ids", "row_tokens", "token_slots", "cls_index"}
    assert padded.layout() == {}
    doubled = jax.tree.map(lambda v: np.stack([v, v]), packed)
    assert type(doubled) is PackedBatch
    assert doubled.cls_index.shape == (2,) + packed.cls_index.shape
    # a padded and a packed batch never share a tree structure (so never a compiled program)
    assert jax.tree.structure(packed) != jax.tree.structure(padded)


def test_views_drop_exactly_what_their_consumer_does_not_read() -> None:
    packed, _ = _packed_and_padded()
    training = packed.for_training()
    assert training.example_index is None and packed.example_index is not None
    assert training.labels is packed.labels and training.step_mask is packed.step_mask
    inputs = packed.model_inputs()
    dropped = ("labels", "example_mask", "step_mask", "example_index")
    assert all(getattr(inputs, name) is None for name in dropped)
    kept = ("input_ids", "attention_mask", "token_type_ids", *packed.layout())
    assert all(getattr(inputs, name) is getattr(packed, name) for name in kept)
    assert len(jax.tree.leaves(inputs)) == len(kept)
    with pytest.raises(dataclasses.FrozenInstanceError):
        packed.labels = None  # frozen: replace() makes a new batch


def test_apply_batch_runs_either_kind_to_the_same_logits() -> None:
    apply, params = tiny_model(num_labels=3, dropout=0.0)
    packed, padded = _packed_and_padded()
    direct = apply(
        params, padded.input_ids, padded.attention_mask, padded.token_type_ids, train=False
    )
    np.testing.assert_array_equal(apply_batch(apply, params, padded, train=False), direct)
    # the packed layout reaches the model: the same examples give the same logits
    got = jax.jit(lambda p, b: apply_batch(apply, p, b, train=False))(params, packed)
    np.testing.assert_allclose(got, direct, atol=1e-5)


def test_segments_pass_through_jit_scan_and_vmap_as_pytrees() -> None:
    (seg,) = make_segments(np.random.default_rng(1), [2, 1], 2)
    assert type(seg) is Batch and seg.step_mask.shape == (2, 2)

    @jax.jit
    def real_rows(s: Batch) -> jax.Array:
        def per_client(c: Batch) -> jax.Array:
            def step(total, b):
                return total + jnp.where(b.step_mask, b.example_mask.sum(), 0.0), None

            return jax.lax.scan(step, jnp.zeros([]), c)[0]

        return jax.vmap(per_client)(s)

    want = [(seg.example_mask[k] * seg.step_mask[k][:, None]).sum() for k in range(2)]
    np.testing.assert_array_equal(real_rows(seg), want)
