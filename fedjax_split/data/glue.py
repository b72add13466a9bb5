"""GLUE's pool (train + validation merged) from a local directory or the Hugging Face hub.

A local directory holds GLUE's original TSV layout (SST-2/train.tsv, dev.tsv; MNLI/dev_matched.tsv,
dev_mismatched.tsv; CoLA without a header) or the hub's parquet layout (sst2/train-*.parquet,
validation-*.parquet; mnli/validation_matched-*), as the GLUE root or the task's folder
(`load_local`); the hub is `datasets.load_dataset("nyu-mll/glue", name)` (`load_hub`). MNLI's
pool is train + dev_matched + dev_mismatched, with `groups` recording the origin ("matched" for
train and dev_matched, "mismatched" for dev_mismatched) so metrics can be reported per origin.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fedjax_split.data.examples import Examples, checked_examples
from fedjax_split.errors import UserError, brief
from fedjax_split.tasks.registry import Task

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


@dataclasses.dataclass
class _Rows:
    """A pool's rows gathered split by split: its text columns, raw labels, where each row is
    (file:line), and each row's MNLI group and split."""

    texts: list[list[Any]]
    labels: list[Any] = dataclasses.field(default_factory=list)
    where: list[str] = dataclasses.field(default_factory=list)
    groups: list[str | None] = dataclasses.field(default_factory=list)
    splits: list[str] = dataclasses.field(default_factory=list)

    def add(
        self,
        texts: Sequence[Iterable[Any]],
        labels: list[Any],
        where: list[str],
        group: str | None,
        split: str,
    ) -> None:
        """One split's rows: a column per text field, their labels and where they are."""
        for column, part in zip(self.texts, texts, strict=True):
            column.extend(part)
        self.labels.extend(labels)
        self.where.extend(where)
        self.groups.extend([group] * len(labels))
        self.splits.extend([split] * len(labels))

    def examples(self, task: Task) -> Examples:
        """The rows checked (`checked_examples`); groups only for a task that reports them."""
        groups = self.groups if task.groups else None
        return checked_examples(task, self.texts, self.labels, self.where, groups, self.splits)


def _task_dir(task: Task, data_dir: Path, hint: str | None = None) -> Path:
    """data_dir itself if it holds the task's files, else its sub-folder named for the task;
    `hint`: how to lay the files out, when not --data-dir's."""
    if not data_dir.is_dir():
        raise UserError(f"--data-dir {data_dir} is not a directory; {layout_hint(task)}")
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
        f"task {task.name}: no GLUE files found in {data_dir}; {hint or layout_hint(task)}"
    )


def _has_split_files(d: Path) -> bool:
    return (d / "train.tsv").is_file() or bool(list(d.glob("train*.parquet")))


def layout_hint(task: Task) -> str:
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


# a field may be a whole document: csv's default limit (131,072 characters) would refuse it with
# a traceback (the tokenizer truncates texts to --max-length anyway); 2**31 - 1, a C long's
# maximum on every platform
CSV_FIELD_LIMIT = 2**31 - 1


def _read_tsv(path: Path, hint: str) -> list[list[str]]:
    """The file's rows; UTF-8 with or without a byte-order mark, else one UserError line."""
    csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            return [row for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
    except csv.Error as e:  # Python 3.10: a NUL byte (UTF-16 saved without its mark, say)
        raise UserError(f"{path} is not tab-separated UTF-8 text ({e}); save it as UTF-8. {hint}"
                        ) from None  # fmt: skip
    except UnicodeDecodeError:
        data = path.read_bytes()  # the error's offset is within a chunk: find the line
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise UserError(
                f"{path} is not UTF-8 text (line {line}: byte {data[e.start:e.start + 1]!r}); "
                f"save it as UTF-8. {hint}"
            ) from None
        raise


def _load_tsv_split(
    task: Task, path: Path, hint: str, site: bool = False
) -> tuple[list[list[Any]], list[Any], list[str]]:
    """`site`: a site's file, whose errors reach the federation's server, so they quote none of
    its content (a header-less file's first line is an example)."""
    rows = _read_tsv(path, hint)
    spec = _TSV_COLUMNS[task.name]
    if spec is None:  # CoLA: no header; label in column 1, sentence in column 3
        text_cols, label_col, first, width = (3,), 1, 0, 4
    else:
        if not rows:
            raise UserError(f"task {task.name}: {path} is empty; {hint}")
        header = rows[0]
        missing = [c for c in (*spec[0], spec[1]) if c not in header]
        if missing:
            seen = f"its first line has {len(header)} fields" if site else f"header {header[:6]}"
            raise UserError(f"task {task.name}: {path} lacks columns {missing} ({seen}); {hint}")
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
    task: Task, files: list[Path], hint: str
) -> tuple[list[list[Any]], list[Any], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts: list[list[Any]] = [[] for _ in task.text_fields]
    labels: list[Any] = []
    where: list[str] = []
    for path in files:
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:  # truncated, or not parquet at all
            raise UserError(f"{path} is not a readable parquet file ({brief(e)}); {hint}") from None
        missing = [c for c in (*task.text_fields, task.label_field) if c not in table.column_names]
        if missing:
            raise UserError(f"task {task.name}: {path} lacks columns {missing}; {hint}")
        for column, field in zip(texts, task.text_fields, strict=True):
            column.extend(table.column(field).to_pylist())
        labels.extend(table.column(task.label_field).to_pylist())
        where.extend(f"{path.name}:row {i}" for i in range(table.num_rows))
    return texts, labels, where


def load_local(task: Task, data_dir: Path, site: bool = False) -> Examples:
    """The task's GLUE files in `data_dir`; `site`: one site's own files, where only the train
    file is required (the dev files, when there, are the site's test split)."""
    hint = _site_hint(task) if site else layout_hint(task)
    d = _task_dir(task, data_dir, hint)
    rows = _Rows([[] for _ in task.text_fields])
    for split, stem, hub_split, group in _SPLITS.get(task.name, _DEFAULT_SPLITS):
        tsv = d / f"{stem}.tsv"
        parquet = sorted(d.glob(f"{hub_split}-*.parquet")) + sorted(d.glob(f"{hub_split}.parquet"))
        if tsv.is_file():
            t, y, w = _load_tsv_split(task, tsv, hint, site)
        elif parquet:
            t, y, w = _load_parquet_split(task, parquet, hint)
        elif site and split != "train":
            continue
        else:
            raise UserError(
                f"task {task.name}: {d} has no {stem}.tsv or {hub_split}-*.parquet; {hint}"
            )
        rows.add(t, y, w, group, split)
    return rows.examples(task)


def load_hub(task: Task) -> Examples:
    """The GLUE task's splits from the Hugging Face hub; one UserError line when it fails."""
    if task.kind != "glue":
        raise UserError(
            f"task {task.name} is not on the hub's {HUB_DATASET}; use source 'offline' (or auto)"
        )
    try:
        import datasets

        ds = datasets.load_dataset(HUB_DATASET, task.name)
    except Exception as e:  # noqa: BLE001 - any failure of the hub means: supply the data locally
        raise UserError(
            f"task {task.name}: could not load {HUB_DATASET}/{task.name} from the Hugging Face hub "
            f"({type(e).__name__}: {brief(e)}); {layout_hint(task)}"
        ) from None
    rows = _Rows([[] for _ in task.text_fields])
    for split, _, hub_split, group in _SPLITS.get(task.name, _DEFAULT_SPLITS):
        if hub_split not in ds:
            raise UserError(f"task {task.name}: hub dataset has no split {hub_split!r}")
        part = ds[hub_split]
        texts = [part[field] for field in task.text_fields]
        y = list(part[task.label_field])
        rows.add(texts, y, [f"{hub_split}:row {i}" for i in range(len(y))], group, split)
    return rows.examples(task)
