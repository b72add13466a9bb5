"""Dynamic masking: BERT's 15% / 80-10-10 statistics, special tokens never selected, static
prediction slots, reproducibility from explicit seeds, padding rows predicting nothing."""

from __future__ import annotations

import numpy as np
import pytest

from fedjax_split.data.batch import Batch
from fedjax_split.data.text.masking import (
    MaskedBatch,
    MaskingSpec,
    mask_batch,
    mask_tokens,
    prediction_slots,
    selected_count,
    spec_from_tokenizer,
)
from fedjax_split.tasks.objectives import IGNORE

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPEC = MaskingSpec(mask_id=MASK, vocab_size=1000, special_ids=(PAD, UNK, CLS, SEP, MASK))


def _rows(rng: np.random.Generator, n: int = 4000, t: int = 64):
    """[CLS] words [SEP] padding; some words are [UNK] (special: never selected)."""
    lengths = rng.integers(3, t + 1, n)
    ids = rng.integers(5, 1000, (n, t)).astype(np.int32)
    ids[rng.random((n, t)) < 0.02] = UNK
    pos = np.arange(t)
    ids[:, 0] = CLS
    ids[np.arange(n), lengths - 1] = SEP
    ids[pos >= lengths[:, None]] = PAD
    mask = (pos < lengths[:, None]).astype(np.int32)
    return ids, mask


def test_selection_rate_shares_and_specials() -> None:
    ids, mask = _rows(np.random.default_rng(0))
    masked, positions, labels = mask_tokens(ids, mask, SPEC, np.random.default_rng(1))
    used = labels != IGNORE
    candidates = ((mask > 0) & ~np.isin(ids, SPEC.special_ids)).sum(-1)
    # exactly round(0.15 n) per row (at least 1), written out independently of selected_count
    want = [max(1, int(np.floor(0.15 * n + 0.5))) if n else 0 for n in candidates]
    assert used.sum(-1).tolist() == want
    assert abs(used.sum() / candidates.sum() - 0.15) < 0.005
    rows = np.nonzero(used)[0]
    cols = positions[used]
    assert not np.isin(ids[rows, cols], SPEC.special_ids).any()  # never a special token
    assert (mask[rows, cols] > 0).all()  # never padding
    assert (labels[used] == ids[rows, cols]).all()  # labels are the original tokens
    assert all(len(set(p[u])) == u.sum() for p, u in zip(positions, used, strict=True))  # distinct
    shown = masked[rows, cols]
    is_mask = shown == MASK
    kept = shown == ids[rows, cols]
    n = used.sum()
    assert abs(is_mask.mean() - 0.8) < 0.01
    # a random replacement hits the original token 1/1000 of the time: those count as kept
    assert abs((~is_mask & ~kept).mean() - 0.1 * 0.999) < 0.01
    assert abs(kept.mean() - (0.1 + 0.1 / 1000)) < 0.01 and n > 15000
    # nothing else changed
    untouched = np.ones(ids.shape, bool)
    untouched[rows, cols] = False
    assert (masked[untouched] == ids[untouched]).all()
    assert (positions[~used] == 0).all()


def test_slots_bound_the_selection_and_seeds_reproduce() -> None:
    assert [prediction_slots(t, 0.15) for t in (1, 8, 64, 128, 512)] == [1, 2, 10, 20, 77]
    n = np.arange(0, 600)
    assert (selected_count(n, 0.15) <= [prediction_slots(int(x), 0.15) for x in n]).all()
    ids, mask = _rows(np.random.default_rng(0), n=50, t=128)
    a = mask_tokens(ids, mask, SPEC, np.random.default_rng([7, 3, 2, 1]))
    b = mask_tokens(ids, mask, SPEC, np.random.default_rng([7, 3, 2, 1]))
    c = mask_tokens(ids, mask, SPEC, np.random.default_rng([7, 4, 2, 1]))  # the next round
    assert a[1].shape == (50, 20)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[1], c[1])  # dynamic: masks drawn afresh each round


def test_mask_batch_keeps_padding_rows_out_and_feeds_the_model_positions() -> None:
    ids, mask = _rows(np.random.default_rng(3), n=6, t=16)
    batch = Batch(
        input_ids=ids.reshape(2, 3, 16),
        attention_mask=mask.reshape(2, 3, 16),
        token_type_ids=np.zeros((2, 3, 16), np.int32),
        labels=np.zeros((2, 3), np.int32),
        example_mask=np.array([[1, 1, 0], [1, 0, 0]], np.float32),
        step_mask=np.array([True, True]),
    )
    out = mask_batch(batch, SPEC, np.random.default_rng(0))
    assert isinstance(out, MaskedBatch) and out.positions.shape == (2, 3, 3)
    assert out.labels.shape == (2, 3, 3)
    assert (out.labels[batch.example_mask == 0] == IGNORE).all()
    assert (out.labels[batch.example_mask == 1] != IGNORE).any(axis=-1).all()
    assert out.layout() == {"positions": out.positions}
    assert out.model_inputs().positions is out.positions and out.model_inputs().labels is None
    np.testing.assert_array_equal(out.step_mask, batch.step_mask)


def test_spec_from_a_real_style_tokenizer(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizer.from_pretrained(str(tmp_path))
    spec = spec_from_tokenizer(tok)
    assert (spec.mask_id, spec.vocab_size, spec.special_ids) == (4, 7, (0, 1, 2, 3, 4))
    with pytest.raises(ValueError, match="rate"):
        MaskingSpec(mask_id=4, vocab_size=7, special_ids=(), rate=0.0)
