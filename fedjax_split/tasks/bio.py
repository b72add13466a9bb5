"""BIO (IOB2) tags: the tag vocabulary, a token model's predictions read back as word tags,
entity spans and entity-level precision/recall/F1.

Spans follow seqeval's strict IOB2 mode (`classification_report(..., mode="strict",
scheme=IOB2)`), the figure NER papers report: an entity starts at a B-X tag and runs over the
I-X tags right after it; an I-X that does not continue a B-X/I-X of the same type (after O, after
another type, first in a sentence) belongs to no entity; a B-X ends whatever came before. Scores
are micro-averaged over all entities of all sentences: precision = tp / predicted, recall = tp /
true, F1 their harmonic mean, each 0 when its denominator is 0 (seqeval's zero_division default,
without its warning).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

Span = tuple[str, int, int]  # (entity type, first token, one past the last token)


def entity_types(tag_lists: Iterable[Sequence[str]]) -> list[str]:
    """The entity types named by B-/I- tags, sorted."""
    return sorted({tag[2:] for tags in tag_lists for tag in tags if tag[:2] in ("B-", "I-")})


def tag_vocabulary(types: Sequence[str]) -> list[str]:
    """["O", "B-t1", "I-t1", "B-t2", ...]: O first, then each type's B and I in sorted order."""
    return ["O"] + [f"{prefix}-{t}" for t in sorted(types) for prefix in ("B", "I")]


def check_tags(tags: Sequence[str], where: str = "") -> None:
    """Raises ValueError for a tag that is not O, B-type or I-type."""
    for i, tag in enumerate(tags):
        if tag != "O" and (tag[:2] not in ("B-", "I-") or len(tag) < 3):
            raise ValueError(f"{where}token {i}: tag {tag!r} is not O, B-<type> or I-<type>")


def stray_inside(tags: Sequence[str]) -> int:
    """I- tags that start an entity (IOB1's way, not after B-/I- of their type): strict IOB2
    (`spans`) counts no entity at them."""
    return sum(
        tag.startswith("I-") and (i == 0 or tags[i - 1] not in (f"B-{tag[2:]}", tag))
        for i, tag in enumerate(tags)
    )


def spans(tags: Sequence[str]) -> list[Span]:
    """The entities of one sentence under strict IOB2 (see the module docstring)."""
    out: list[Span] = []
    i, n = 0, len(tags)
    while i < n:
        tag = tags[i]
        if tag.startswith("B-"):
            kind, end = tag[2:], i + 1
            while end < n and tags[end] == f"I-{kind}":
                end += 1
            out.append((kind, i, end))
            i = end
        else:
            i += 1
    return out


def entity_scores(
    true_tags: Sequence[Sequence[str]], pred_tags: Sequence[Sequence[str]]
) -> dict[str, float]:
    """Micro precision, recall and F1 of the predicted entities against the true ones, plus
    `f1_<type>` for every type among either. Sentences pair up in order and must be of equal
    length."""
    if len(true_tags) != len(pred_tags):
        raise ValueError(f"{len(true_tags)} true sentences against {len(pred_tags)} predicted")
    true: set[tuple[int, Span]] = set()
    pred: set[tuple[int, Span]] = set()
    for s, (t, p) in enumerate(zip(true_tags, pred_tags, strict=True)):
        if len(t) != len(p):
            raise ValueError(f"sentence {s}: {len(t)} true tags against {len(p)} predicted")
        true.update((s, span) for span in spans(t))
        pred.update((s, span) for span in spans(p))
    scores = _prf(len(true & pred), len(pred), len(true))
    for kind in sorted({span[0] for _, span in true | pred}):
        t = {x for x in true if x[1][0] == kind}
        p = {x for x in pred if x[1][0] == kind}
        scores[f"f1_{kind}"] = _prf(len(t & p), len(p), len(t))["f1"]
    return scores


def _prf(tp: int, predicted: int, actual: int) -> dict[str, float]:
    precision = tp / predicted if predicted else 0.0
    recall = tp / actual if actual else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def word_tags(
    predictions: np.ndarray, labels: np.ndarray, tag_names: tuple[str, ...]
) -> tuple[list[list[str]], list[list[str]]]:
    """(true, predicted) tag sequences of each row, read at the labelled positions (each word's
    first sub-word): what `entity_scores` compares."""
    true, pred = [], []
    for p, y in zip(np.asarray(predictions), np.asarray(labels), strict=True):
        keep = y >= 0
        true.append([tag_names[i] for i in y[keep]])
        pred.append([tag_names[i] for i in p[keep]])
    return true, pred
