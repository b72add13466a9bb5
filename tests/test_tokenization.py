"""Ragged tokenisation vs the tokenizer's own padded output (real MiniLM WordPiece vocab)."""

from __future__ import annotations

import numpy as np
import pytest

from fedjax_split import assets
from fedjax_split.data import tokenization
from fedjax_split.data.tokenization import Tokenized, load_tokenizer, tokenize
from fedjax_split.errors import UserError

A = [
    "The film was a delight from start to finish.",
    "dull",
    "",
    "an uneven, often funny and at times genuinely moving mess " * 6,
    "Unbelievably overlong; I checked my watch 17 times!!",
]
B = [
    "yes",
    "a fairly long second segment that goes on and on " * 5,
    "empty first",
    "and a long second one as well, just to force both to be cut " * 5,
    "ok",
]


@pytest.fixture(scope="module")
def tok():
    try:
        assets.fetch("minilm-l6")
    except UserError as e:
        pytest.skip(str(e))
    return load_tokenizer("minilm-l6")


def _check_against_padded(tok, out: Tokenized, enc) -> None:
    mask = np.asarray(enc["attention_mask"])
    np.testing.assert_array_equal(out.lengths, mask.sum(1))
    assert out.lengths.dtype == np.int32
    for i, n in enumerate(out.lengths):
        assert out.input_ids[i].dtype == np.int32 and out.token_type_ids[i].dtype == np.int32
        np.testing.assert_array_equal(out.input_ids[i], enc["input_ids"][i][:n])
        np.testing.assert_array_equal(out.token_type_ids[i], enc["token_type_ids"][i][:n])
        assert (np.asarray(enc["input_ids"][i][n:]) == tok.pad_token_id).all()


def test_single_sentences_match_padded_output(tok):
    out = tokenize(tok, A, max_length=16)
    enc = tok(A, padding="max_length", truncation=True, max_length=16)
    _check_against_padded(tok, out, enc)
    assert out.lengths.max() == 16 and out.lengths[2] == 2  # "" -> [CLS] [SEP]
    assert out.input_ids[1].tolist() == [tok.cls_token_id, tok.vocab["dull"], tok.sep_token_id]


def test_pairs_truncated_longest_first(tok):
    out = tokenize(tok, A, B, max_length=32)
    enc = tok(A, B, padding="max_length", truncation="longest_first", max_length=32)
    _check_against_padded(tok, out, enc)
    # example 3: both segments long -> cut to equal-ish halves; example 1: only B is cut
    types = out.token_type_ids[3]
    assert len(types) == 32 and abs(int((types == 0).sum()) - int((types == 1).sum())) <= 1
    assert out.input_ids[1][:3].tolist() == [tok.cls_token_id, tok.vocab["dull"], tok.sep_token_id]
    assert out.token_type_ids[0].tolist() == [0] * (len(out.input_ids[0]) - 2) + [1, 1]


def test_default_max_length_is_128(tok):
    out = tokenize(tok, ["word " * 500])
    assert out.lengths.tolist() == [128] and out.input_ids[0][-1] == tok.sep_token_id


def test_chunking_gives_the_same_result(tok, monkeypatch):
    whole = tokenize(tok, A, B, max_length=24)
    monkeypatch.setattr(tokenization, "_CHUNK", 2)
    chunked = tokenize(tok, A, B, max_length=24)
    np.testing.assert_array_equal(whole.lengths, chunked.lengths)
    for x, y in zip(whole.input_ids + whole.token_type_ids,
                    chunked.input_ids + chunked.token_type_ids, strict=True):  # fmt: skip
        np.testing.assert_array_equal(x, y)


def test_empty_and_mismatched_inputs(tok):
    out = tokenize(tok, [])
    assert out.input_ids == [] and out.lengths.shape == (0,) and out.lengths.dtype == np.int32
    with pytest.raises(ValueError, match="second texts"):
        tokenize(tok, A, B[:2])


def test_directory_without_tokenizer_files(tmp_path):
    with pytest.raises(UserError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_local_directory_with_only_vocab(tmp_path):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    t = load_tokenizer(tmp_path)
    out = tokenize(t, ["Hello worlds", "zzz"])
    assert [x.tolist() for x in out.input_ids] == [[2, 5, 6, 7, 3], [2, 1, 3]]


def test_align_labels_first_subword_only() -> None:
    from fedjax_split.tasks.objectives import IGNORE

    # [CLS] un ##believ ##ably film [SEP]: word 0 has three sub-words
    got = tokenization.align_labels([None, 0, 0, 0, 1, None], [3, 5])
    np.testing.assert_array_equal(got, [IGNORE, 3, IGNORE, IGNORE, 5, IGNORE])
    assert got.dtype == np.int32


def test_tokenize_words_labels_each_words_first_piece_and_counts_truncation(tok) -> None:
    from fedjax_split.tasks.objectives import IGNORE

    words = [["Unbelievably", "overlong", "film"], ["ok"]]
    labels = [[1, 2, 0], [4]]
    out, lost = tokenization.tokenize_words(tok, words, labels, max_length=32)
    assert lost == 0 and out.labels is not None
    pieces = [len(tok.tokenize(w)) for w in words[0]]
    assert pieces[0] > 1 and pieces[1] > 1  # the words really split into sub-words
    want = [IGNORE]
    for n, y in zip(pieces, labels[0], strict=True):
        want += [y] + [IGNORE] * (n - 1)
    np.testing.assert_array_equal(out.labels[0], want + [IGNORE])
    np.testing.assert_array_equal(out.labels[1], [IGNORE, 4, IGNORE])
    assert [len(x) for x in out.input_ids] == [len(x) for x in out.labels] == out.lengths.tolist()
    # truncation: with room for [CLS] + 2 pieces + [SEP], the later words are cut and counted
    short, lost = tokenization.tokenize_words(tok, words[:1], labels[:1], max_length=4)
    assert lost == 2 and short.lengths.tolist() == [4]
    np.testing.assert_array_equal(short.labels[0], [IGNORE, 1, IGNORE, IGNORE])
