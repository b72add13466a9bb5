"""data.tokens.conll: CoNLL-style files as the corpora write them."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedjax_split.data.tokens.conll import find_split_files, parse_conll, read_conll, write_conll
from fedjax_split.errors import UserError


def test_columns_separators_and_docstart() -> None:
    text = [
        "-DOCSTART- -X- O O\n", "\n",
        "EU NNP B-NP B-ORG\n", "rejects VBZ B-VP O\n", "\n", "\n",  # CoNLL-2003's four columns
        "@paulwalk\tO\r\n", "Empire\tB-facility\n", "\t\n",  # a lone tab ends a sentence
        "ESB\tB-facility\n",  # and the end of the file ends the last
    ]  # fmt: skip
    assert parse_conll(text) == [
        (["EU", "rejects"], ["B-ORG", "O"]),
        (["@paulwalk", "Empire"], ["O", "B-facility"]),
        (["ESB"], ["B-facility"]),
    ]


def test_write_read_round_trip_and_errors(tmp_path: Path) -> None:
    sentences = [(["a", "b"], ["B-x", "I-x"]), (["c"], ["O"])]
    path = write_conll(tmp_path / "train.txt", sentences)
    assert read_conll(path) == sentences
    (tmp_path / "bad.txt").write_text("ok O\nlonely\n")
    with pytest.raises(UserError, match=r"bad.txt:2: a token without a tag column"):
        read_conll(tmp_path / "bad.txt")
    with pytest.raises(UserError, match="cannot read"):
        read_conll(tmp_path / "missing.txt")


def test_split_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no training file"):
        find_split_files(tmp_path)
    for name in ("train.conll", "validation.txt", "test"):
        (tmp_path / name).write_text("a O\n")
    found = find_split_files(tmp_path)
    assert {k: v.name for k, v in found.items()} == {
        "train": "train.conll", "dev": "validation.txt", "test": "test",
    }  # fmt: skip


def test_a_tag_outside_the_vocabulary_names_its_file_and_line(tmp_path: Path) -> None:
    """Given the run's tags, the first one outside them stops the reading at its line (blank
    lines and -DOCSTART- counted: the line a person's editor shows)."""
    path = tmp_path / "train.txt"
    path.write_text("-DOCSTART- O\n\nAnn B-PER\nmet O\n\nBo B-PER\nin O\nParis B-LOC\n")
    tags = ("O", "B-PER", "I-PER")
    with pytest.raises(UserError) as err:
        read_conll(path, tags, "; add it")
    assert str(err.value) == f"{path}:8: tag 'B-LOC' is not in the tag vocabulary; add it"
    assert read_conll(path) == [(["Ann", "met"], ["B-PER", "O"]),
                                (["Bo", "in", "Paris"], ["B-PER", "O", "B-LOC"])]  # fmt: skip
    assert read_conll(path, (*tags, "B-LOC")) == read_conll(path)
    # a word where the tag should be (columns swapped) is not quoted: a site's errors reach the
    # federation's server
    path.write_text("Ann B-PER\nO Smithers\n")
    with pytest.raises(UserError) as err:
        read_conll(path, tags, "; add it")
    assert str(err.value) == (
        f"{path}:2: a value that is not a tag is not in the tag vocabulary; add it"
    )
