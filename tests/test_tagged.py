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

