"""data.tokens.tagged: a token task's pool from CoNLL files, its vocabulary and partition
labels."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedjax_split.data.tokens import tagged
from fedjax_split.data.tokens.conll import write_conll
from fedjax_split.errors import UserError
from fedjax_split.tasks import registry as tasks


def test_pool_from_a_conll_directory(tmp_path: Path) -> None:
    write_conll(tmp_path / "train.txt", [(["Ann", "met", "Bo"], ["B-per", "O", "B-per"])])
    write_conll(tmp_path / "dev.conll", [(["in", "New", "York"], ["O", "B-loc", "I-loc"])])
    write_conll(tmp_path / "test.txt", [(["hi"], ["O"])])
    pool = tagged.load_tagged(tasks.get_task("ner"), tmp_path)
    assert len(pool) == 3 and pool.splits.tolist() == ["train", "dev", "test"]
    assert pool.tag_names == ("O", "B-loc", "I-loc", "B-per", "I-per")
    assert pool.types == ("loc", "per") and pool.partition_names == ("loc", "per", "(none)")
    assert pool.labels.tolist() == [1, 0, 2]
    with pytest.raises(UserError, match="--data-dir"):
        tagged.load_tagged(tasks.get_task("ner"), None)


def test_bad_pools_are_one_line_errors(tmp_path: Path) -> None:
    write_conll(tmp_path / "train.txt", [(["a"], ["O"])])
    with pytest.raises(UserError, match="no entity tags"):
        tagged.load_tagged(tasks.get_task("ner"), tmp_path)
    write_conll(tmp_path / "train.txt", [(["a"], ["U-per"])])
    with pytest.raises(UserError, match="BIO"):
        tagged.load_tagged(tasks.get_task("ner"), tmp_path)


def test_the_runs_entity_types_are_the_vocabulary_whatever_the_files_hold(tmp_path: Path) -> None:
    """With the run's types, the vocabulary is theirs (a type no sentence has still gets its
    tags, and sentences without entities are fine: a small site may hold none); a tag outside it
    is one line naming the file and the line."""
    write_conll(tmp_path / "train.txt", [(["a", "b"], ["O", "O"]), (["Bo"], ["B-per"])])
    pool = tagged.load_tagged(tasks.get_task("ner"), tmp_path, ("per", "loc"))
    assert pool.tag_names == ("O", "B-loc", "I-loc", "B-per", "I-per")
    assert pool.partition_names == ("loc", "per", "(none)") and pool.labels.tolist() == [2, 1]
    write_conll(tmp_path / "train.txt", [(["a"], ["O"])])  # no entity: no "is it NER data?"
    assert tagged.load_tagged(tasks.get_task("ner"), tmp_path, ("per",)).labels.tolist() == [1]
    write_conll(tmp_path / "dev.txt", [(["x"], ["O"]), (["in", "Rome"], ["O", "B-loc"])])
    with pytest.raises(UserError) as err:
        tagged.load_tagged(tasks.get_task("ner"), tmp_path, ("per",))
    assert str(err.value) == (
        f"{tmp_path / 'dev.txt'}:4: tag 'B-loc' is not in the tag vocabulary (O, B-/I- of "
        "--entity-types per); add its type to --entity-types or fix the tag"
    )
    with pytest.raises(UserError, match="of task wnut16's types company,.*; fix the tag$"):
        tagged.load_tagged(tasks.get_task("wnut16"), tmp_path,
                           tasks.get_task("wnut16").entity_types)  # fmt: skip


def test_sentences_not_from_a_file_are_checked_by_sentence() -> None:
    with pytest.raises(UserError, match=r"^nero: sentence 1: tag 'B-x' is not in the tag vocab"):
        tagged.from_sentences([(["a"], ["O"]), (["b"], ["B-x"])], where="nero", types=("y",))
