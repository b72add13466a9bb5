"""Tokenisation with the checkpoint's own fast tokenizer, ragged (unpadded) output.

Padding is left to batching, which pads each length bucket only as far as its longest example, so
short sentences are not padded to `max_length`. Pairs are truncated like HF's `longest_first`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fedjax_split.errors import UserError
from fedjax_split.models.hf_checkpoint import resolve_model
from fedjax_split.tasks.objectives import IGNORE

_CHUNK = 8192  # texts per tokenizer call: bounds the memory of Python lists of ids


class Tokenized(NamedTuple):
    """Ragged token ids: one int32 array per example, with [CLS] ... [SEP] (... [SEP])."""

    input_ids: list[np.ndarray]
    token_type_ids: list[np.ndarray]
    lengths: np.ndarray  # int32 [N]
    labels: list[np.ndarray] | None = None  # a token task's int32 label per token (IGNORE: none)


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> Any:
    """The fast tokenizer stored with a model: alias, local directory or hub id."""
    from transformers import AutoTokenizer

    model_dir: Path = resolve_model(name_or_path)
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "vocab.txt")):
        raise UserError(
            f"no tokenizer files (tokenizer.json or vocab.txt) in {model_dir}; "
            "use a model directory that includes its tokenizer"
        )
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise UserError(
            f"cannot load the tokenizer in {model_dir} ({str(e).splitlines()[0][:200]}); "
            "fix or re-download the tokenizer files"
        ) from None


def tokenizer_identity(tokenizer: Any) -> str:
    """name_or_path + class + sha256 of the full tokenizer definition (vocab, normaliser, ...)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        definition = backend.to_str()
        try:  # truncation/padding are call state that a call leaves behind, not identity
            doc = json.loads(definition)
            doc.pop("truncation", None)
            doc.pop("padding", None)
            definition = json.dumps(doc, sort_keys=True)
        except ValueError:
            pass
        h.update(definition.encode("utf-8"))
    else:
        vocab = tokenizer.get_vocab()
        h.update(json.dumps(sorted(vocab.items())).encode("utf-8"))
    name = str(getattr(tokenizer, "name_or_path", ""))
    return f"{name}|{type(tokenizer).__name__}|{h.hexdigest()}"


def tokenize(
    tokenizer: Any,
    texts_a: Sequence[str],
    texts_b: Sequence[str] | None = None,
    *,
    max_length: int = 128,
) -> Tokenized:
    """Tokenises single sentences or pairs, truncated to `max_length` tokens, without padding."""
    texts_a = list(texts_a)
    if texts_b is not None:
        texts_b = list(texts_b)
        if len(texts_b) != len(texts_a):
            raise ValueError(f"{len(texts_a)} first texts but {len(texts_b)} second texts")
    ids: list[np.ndarray] = []
    types: list[np.ndarray] = []
    for start in range(0, len(texts_a), _CHUNK):
        a = texts_a[start : start + _CHUNK]
        b = None if texts_b is None else texts_b[start : start + _CHUNK]
        enc = tokenizer(
            a,
            b,
            truncation="longest_first",
            max_length=max_length,
            padding=False,
            return_attention_mask=False,
            return_token_type_ids=True,
        )
        ids.extend(np.asarray(x, dtype=np.int32) for x in enc["input_ids"])
        types.extend(np.asarray(x, dtype=np.int32) for x in enc["token_type_ids"])
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int32, count=len(ids))
    return Tokenized(ids, types, lengths)


def align_labels(word_ids: Sequence[int | None], word_labels: Sequence[int]) -> np.ndarray:
    """Per-token labels of a word-tokenised sentence: a word's label on its FIRST sub-word only;
    its other sub-words and the special tokens ([CLS], [SEP]: word id None) get IGNORE, as in
    transformers' token-classification recipe (and seqeval then scores words, not sub-words)."""
    out = np.full(len(word_ids), IGNORE, np.int32)
    previous = None
    for i, w in enumerate(word_ids):
        if w is not None and w != previous:
            out[i] = word_labels[w]
        previous = w
    return out


def tokenize_words(
    tokenizer: Any,
    words: Sequence[Sequence[str]],
    word_labels: Sequence[Sequence[int]],
    *,
    max_length: int = 128,
) -> tuple[Tokenized, int]:
    """Tokenises pre-split sentences (NER) with per-token labels (`align_labels`), truncated to
    `max_length` tokens, unpadded. Returns the Tokenized and how many labelled words truncation
    cut off (their labels are lost: report them)."""
    if len(words) != len(word_labels):
        raise ValueError(f"{len(words)} sentences but {len(word_labels)} label sequences")
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            "token classification needs a fast tokenizer (for word ids); give the model's "
            "tokenizer.json"
        )
    ids: list[np.ndarray] = []
    types: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    lost = 0
    for start in range(0, len(words), _CHUNK):
        chunk = [list(w) for w in words[start : start + _CHUNK]]
        enc = tokenizer(
            chunk,
            is_split_into_words=True,
            truncation=True,
            max_length=max_length,
            padding=False,
            return_attention_mask=False,
            return_token_type_ids=True,
        )
        for j, sentence in enumerate(chunk):
            word_ids = enc.word_ids(j)
            own = word_labels[start + j]
            if len(own) != len(sentence):
                raise ValueError(f"sentence {start + j}: {len(sentence)} words, {len(own)} labels")
            kept = {w for w in word_ids if w is not None}
            lost += len(sentence) - len(kept)
            ids.append(np.asarray(enc["input_ids"][j], np.int32))
            types.append(np.asarray(enc["token_type_ids"][j], np.int32))
            labels.append(align_labels(word_ids, own))
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int32, count=len(ids))
    return Tokenized(ids, types, lengths, labels), lost
