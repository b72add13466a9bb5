"""tasks: registry contents, lookup errors, compute_metrics incl. MNLI matched/mismatched."""

import numpy as np
import pytest

from fedjax_split.errors import UserError
from fedjax_split.tasks.objectives import IGNORE
from fedjax_split.tasks.registry import TASKS, compute_metrics, get_task

GLUE = ("cola", "sst2", "mrpc", "qqp", "mnli", "qnli", "rte", "wnli", "stsb")


def test_registry_has_glue_and_offline_corpora():
    assert set(GLUE) | {"rotten_tomatoes", "20news", "trec", "ner", "wnut16", "nero"} == set(TASKS)
    for name in ("ner", "wnut16", "nero"):  # token tasks: tags come from the data
        t = get_task(name)
        assert t.objective.per_token and t.primary_metric == "f1" and t.num_labels == 0
    assert get_task("qnli").text_fields == ("question", "sentence")
    assert get_task("mnli").text_fields == ("premise", "hypothesis")
    assert get_task("mnli").label_names == ("entailment", "neutral", "contradiction")
    assert get_task("cola").primary_metric == "matthews_corrcoef"
    assert get_task("mrpc").metrics == ("f1", "accuracy")
    stsb = get_task("stsb")
    assert stsb.is_regression and stsb.num_labels == 1 and stsb.metrics == ("pearson", "spearman")
    assert get_task("20news").num_labels == 20 and get_task("trec").num_labels == 6
    assert get_task("rotten_tomatoes").label_names == ("rotten", "fresh")
    for t in TASKS.values():
        assert t.primary_metric in t.metrics
        assert t.is_regression or t.num_labels == len(t.label_names)
        assert t.is_pair == (t.name in ("mrpc", "qqp", "mnli", "qnli", "rte", "wnli", "stsb"))


def test_aliases_and_unknown_task():
    assert get_task("SST-2").name == "sst2" and get_task("STS-B").name == "stsb"
    with pytest.raises(UserError, match="unknown task 'imdb'; known tasks: cola, sst2") as e:
        get_task("imdb")
    assert "\n" not in str(e.value)


def test_compute_metrics_per_task():
    y = np.array([1, 0, 1, 1])
    p = np.array([1, 1, 1, 0])
    out = compute_metrics("mrpc", p, y)
    assert out == {"f1": pytest.approx(2 * 2 / (2 * 2 + 1 + 1)), "accuracy": 0.5}
    assert set(compute_metrics("cola", p, y)) == {"matthews_corrcoef"}
    s = compute_metrics("stsb", np.array([0.1, 2.0, 3.0]), np.array([0.0, 2.5, 4.0]))
    assert set(s) == {"pearson", "spearman"} and s["spearman"] == pytest.approx(1.0)


def test_mnli_matched_and_mismatched_reported_apart():
    y = np.array([0, 1, 2, 0, 1, 2])
    p = np.array([0, 1, 2, 1, 1, 0])
    g = np.array(["matched"] * 3 + ["mismatched"] * 3)
    out = compute_metrics("mnli", p, y, groups=g)
    assert out == {"accuracy": 4 / 6, "accuracy_matched": 1.0, "accuracy_mismatched": 1 / 3}
    only = compute_metrics("mnli", p[:3], y[:3], groups=g[:3])
    assert "accuracy_mismatched" not in only


def test_token_task_scored_as_entities_at_labelled_positions() -> None:
    names = ("O", "B-x", "I-x")
    labels = np.array(
        [[IGNORE, 1, IGNORE, 2, 0, IGNORE], [IGNORE, 0, IGNORE, IGNORE, IGNORE, IGNORE]]
    )
    preds = np.array([[2, 1, 2, 0, 1, 1], [1, 1, 1, 1, 1, 1]])
    scores = compute_metrics("wnut16", preds, labels, label_names=names)
    # true: one entity (x, 0..2); predicted: (x, 0..1), (x, 2..3), (x, 0..1) in sentence 2
    assert scores["precision"] == 0.0 and scores["recall"] == 0.0 and scores["f1"] == 0.0
    perfect = compute_metrics("wnut16", np.where(labels < 0, 0, labels), labels, label_names=names)
    assert perfect["f1"] == 1.0 and perfect["f1_x"] == 1.0
    with pytest.raises(ValueError, match="tag names"):
        compute_metrics("wnut16", preds, labels)


def test_the_offline_ner_corpora_fix_their_entity_types_and_ner_does_not() -> None:
    """A task's own types are its tag vocabulary wherever its data come from (sites included);
    `ner` has none: --entity-types gives them. Sorted, as a pool's own types are
    (tests/test_ner_corpora.py checks them against the corpora)."""
    assert get_task("ner").entity_types == ()
    wnut, nero = get_task("wnut16").entity_types, get_task("nero").entity_types
    assert len(wnut) == 10 and "geo-loc" in wnut and list(wnut) == sorted(wnut)
    assert len(nero) == 8 and "Protein" in nero and list(nero) == sorted(nero)
    assert all(t.entity_types == () for t in TASKS.values() if not t.objective.per_token)
