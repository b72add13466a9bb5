"""A client's MLM steps: one shape for every segment, each sequence once per epoch in a fresh
order, padded steps masked, masks and order from the explicit seed only."""

from __future__ import annotations

import numpy as np

from fedjax_split.data.text import mlm_batching
from fedjax_split.data.text.masking import MaskingSpec
from fedjax_split.data.text.text_corpora import Sequences
from fedjax_split.tasks.objectives import IGNORE

SPEC = MaskingSpec(mask_id=4, vocab_size=60, special_ids=(0, 1, 2, 3, 4))


def _seqs(n: int, t: int = 16) -> Sequences:
    ids = np.zeros((n, t), np.int32)
    lengths = np.full(n, t, np.int32)
    lengths[-1] = 7  # a client's last sequence is short
    for i in range(n):
        ids[i, : lengths[i]] = 5 + (np.arange(lengths[i]) + i) % 50
        ids[i, 0], ids[i, lengths[i] - 1] = 2, 3
    return Sequences(ids, lengths)


def test_segments_cover_each_sequence_once_per_epoch() -> None:
    seqs = _seqs(11)
    segs = mlm_batching.train_segments(seqs, batch_size=4, epochs=2, steps_per_segment=4,
                                       masking=SPEC, seed=[0, 3, 1])  # fmt: skip
    assert len(segs) == 2  # 2 epochs x 3 steps = 6 steps in 2 segments of 4
    assert {s.input_ids.shape for s in segs} == {(4, 4, 16)}
    assert {s.positions.shape for s in segs} == {(4, 4, 3)}
    steps = np.concatenate([s.step_mask for s in segs])
    assert steps.tolist() == [True] * 6 + [False] * 2
    rows = np.concatenate([s.example_index for s in segs])[steps]
    epochs = rows.reshape(2, -1)
    for epoch in epochs:
        assert sorted(epoch[epoch >= 0].tolist()) == list(range(11))
    assert epochs[0].tolist() != epochs[1].tolist()  # reshuffled
    mask = np.concatenate([s.example_mask for s in segs])
    assert ((rows >= 0) == (mask[steps] > 0)).all()
    labels = np.concatenate([s.labels for s in segs])[steps]
    assert (labels[rows < 0] == IGNORE).all()
    # masked inputs differ from the text only at the predicted positions
    first = segs[0]
    for b in range(4):
        real = first.example_index[0, b]
        original = seqs.input_ids[real]
        changed = np.nonzero(first.input_ids[0, b] != original)[0]
        assert set(changed) <= set(first.positions[0, b][first.labels[0, b] != IGNORE])


def test_the_seed_fixes_order_and_masks() -> None:
    seqs = _seqs(9)
    kw = {"batch_size": 4, "epochs": 1, "steps_per_segment": 8, "masking": SPEC}
    a = mlm_batching.train_segments(seqs, seed=[0, 2, 5], **kw)
    b = mlm_batching.train_segments(seqs, seed=[0, 2, 5], **kw)
    c = mlm_batching.train_segments(seqs, seed=[0, 3, 5], **kw)
    assert all(np.array_equal(x.input_ids, y.input_ids) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0].example_index, c[0].example_index)
    held = mlm_batching.eval_batches(seqs, batch_size=4, masking=SPEC, seed=[0, 0, 7])
    assert [h.input_ids.shape for h in held] == [(4, 16)] * 3
    assert np.concatenate([h.example_index for h in held]).tolist() == [*range(9), -1, -1, -1]
    again = mlm_batching.eval_batches(seqs, batch_size=4, masking=SPEC, seed=[0, 0, 7])
    assert all(np.array_equal(x.labels, y.labels) for x, y in zip(held, again, strict=True))
    # the held-out masks do not depend on the batch size
    wide = mlm_batching.eval_batches(seqs, batch_size=16, masking=SPEC, seed=[0, 0, 7])
    np.testing.assert_array_equal(wide[0].labels[:9], np.concatenate([h.labels for h in held])[:9])
