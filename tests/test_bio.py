"""tasks.bio: entity spans and scores against seqeval's strict IOB2 mode (the independent
reference NER papers report), on hand-made odd cases and on random tag sequences."""

from __future__ import annotations

import numpy as np
import pytest

from fedjax_split.tasks.bio import (
    check_tags,
    entity_scores,
    entity_types,
    spans,
    tag_vocabulary,
    word_tags,
)
from fedjax_split.tasks.objectives import IGNORE

seqeval_metrics = pytest.importorskip("seqeval.metrics")
from seqeval.scheme import IOB2  # noqa: E402


def _seqeval(true, pred) -> dict[str, float]:
    kw = {"mode": "strict", "scheme": IOB2, "zero_division": 0}
    return {
        "precision": seqeval_metrics.precision_score(true, pred, **kw),
        "recall": seqeval_metrics.recall_score(true, pred, **kw),
        "f1": seqeval_metrics.f1_score(true, pred, **kw),
    }


ODD = [  # (true, predicted): every case where strict IOB2 differs from a lenient reading
    (["B-PER", "I-PER", "O"], ["B-PER", "I-PER", "O"]),
    (["B-PER", "I-PER", "O"], ["I-PER", "I-PER", "O"]),  # I- starts nothing in strict mode
    (["B-PER", "I-PER", "O"], ["B-PER", "I-LOC", "O"]),  # type change ends the entity
    (["B-LOC", "B-LOC", "I-LOC"], ["B-LOC", "I-LOC", "I-LOC"]),  # B- ends what came before
    (["O", "I-ORG", "I-ORG"], ["O", "B-ORG", "I-ORG"]),  # a stray I- run in the truth
    (["B-A", "O", "B-A"], ["B-A", "O", "O"]),
    (["O", "O"], ["O", "O"]),  # nothing to find, nothing found: all 0
    (["O", "O"], ["B-X", "O"]),  # only false positives
    (["B-X", "I-X", "I-X", "I-X"], ["B-X", "I-X", "B-X", "I-X"]),
]


@pytest.mark.parametrize(("true", "pred"), ODD)
def test_odd_cases_match_seqeval_strict(true: list[str], pred: list[str]) -> None:
    got = entity_scores([true], [pred])
    want = _seqeval([true], [pred])
    for k in want:
        assert got[k] == pytest.approx(want[k]), k


def test_random_sequences_match_seqeval_strict() -> None:
    rng = np.random.default_rng(0)
    vocab = ["O", "B-A", "I-A", "B-B", "I-B", "B-C", "I-C"]
    for _ in range(40):
        lengths = rng.integers(1, 12, size=rng.integers(1, 8))
        true = [list(rng.choice(vocab, n, p=[0.4] + [0.1] * 6)) for n in lengths]
        pred = [
            [t if rng.random() < 0.7 else str(rng.choice(vocab)) for t in sent] for sent in true
        ]
        got, want = entity_scores(true, pred), _seqeval(true, pred)
        for k in want:
            assert got[k] == pytest.approx(want[k]), (k, true, pred)


def test_hand_computed_scores_and_spans() -> None:
    assert spans(["B-PER", "I-PER", "O", "I-LOC", "B-LOC"]) == [("PER", 0, 2), ("LOC", 4, 5)]
    true = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG"]]
    pred = [["B-PER", "I-PER", "O", "O"], ["B-ORG"]]  # 2 of 3 found, none wrong
    scores = entity_scores(true, pred)
    assert scores["precision"] == 1.0 and scores["recall"] == pytest.approx(2 / 3)
    assert scores["f1"] == pytest.approx(0.8)
    assert scores["f1_PER"] == 1.0 and scores["f1_LOC"] == 0.0 and scores["f1_ORG"] == 1.0
    with pytest.raises(ValueError, match="sentence 0"):
        entity_scores([["O"]], [["O", "O"]])


def test_vocabulary_types_and_tag_checks() -> None:
    tags = [["B-per", "I-per", "O"], ["B-geo-loc", "O"]]
    assert entity_types(tags) == ["geo-loc", "per"]
    assert tag_vocabulary(["per", "geo-loc"]) == ["O", "B-geo-loc", "I-geo-loc", "B-per", "I-per"]
    check_tags(["O", "B-x", "I-x"])
    for bad in ("S-x", "B-", "PER", "b-x"):
        with pytest.raises(ValueError, match="token 1"):
            check_tags(["O", bad])


def test_word_tags_read_labelled_positions_only() -> None:
    names = ("O", "B-x", "I-x")
    labels = np.array(
        [[IGNORE, 1, IGNORE, 2, 0, IGNORE], [IGNORE, 0, IGNORE, IGNORE, IGNORE, IGNORE]]
    )
    preds = np.array([[2, 1, 2, 0, 1, 1], [1, 1, 1, 1, 1, 1]])
    true, pred = word_tags(preds, labels, names)
    assert true == [["B-x", "I-x", "O"], ["O"]] and pred == [["B-x", "O", "B-x"], ["B-x"]]
