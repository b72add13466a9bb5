"""data.tagged: a token task's pool from CoNLL files, its vocabulary and partition labels, and
the word-level tags that entity scores read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedjax_split.data import tagged, tasks
from fedjax_split.data.conll import write_conll
from fedjax_split.data.objectives import IGNORE
from fedjax_split.errors import UserError


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


def test_word_tags_read_labelled_positions_only() -> None:
    names = ("O", "B-x", "I-x")
    labels = np.array(
        [[IGNORE, 1, IGNORE, 2, 0, IGNORE], [IGNORE, 0, IGNORE, IGNORE, IGNORE, IGNORE]]
    )
    preds = np.array([[2, 1, 2, 0, 1, 1], [1, 1, 1, 1, 1, 1]])
    true, pred = tagged.word_tags(preds, labels, names)
    assert true == [["B-x", "I-x", "O"], ["O"]] and pred == [["B-x", "O", "B-x"], ["B-x"]]
    scores = tasks.compute_metrics("wnut16", preds, labels, label_names=names)
    # true: one entity (x, 0..2); predicted: (x, 0..1), (x, 2..3), (x, 0..1) in sentence 2
    assert scores["precision"] == 0.0 and scores["recall"] == 0.0 and scores["f1"] == 0.0
    perfect = tasks.compute_metrics(
        "wnut16", np.where(labels < 0, 0, labels), labels, label_names=names
    )
    assert perfect["f1"] == 1.0 and perfect["f1_x"] == 1.0
    with pytest.raises(ValueError, match="tag names"):
        tasks.compute_metrics("wnut16", preds, labels)
