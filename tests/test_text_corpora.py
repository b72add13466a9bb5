"""Text corpora: local .txt files (blank-line documents), the hub path through `datasets` on local
files of the same format, PubMed from a data dir, the token cache, and sequences in document
(one stream, full rows) and line (one truncated row per line) modes."""

from __future__ import annotations

import numpy as np
import pytest

from fedjax_split.data.text import text_corpora
from fedjax_split.data.text.text_corpora import TextCorpus, TextUnits
from fedjax_split.errors import UserError


class _WordTokenizer:
    """A stand-in fast tokenizer: a word's id is its length + 10; counts its calls."""

    name_or_path = "words"
    backend_tokenizer = None

    def __init__(self) -> None:
        self.calls = 0

    def get_vocab(self) -> dict[str, int]:
        return {"w": 1}

    def __call__(self, texts, **kwargs):
        assert kwargs["add_special_tokens"] is False and kwargs["truncation"] is False
        self.calls += 1
        return {"input_ids": [[len(w) + 10 for w in t.split()] for t in texts]}


def test_local_text_files_and_modes(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("first doc line one\nline two\n\n\nsecond doc\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("third\r\n\r\nfourth doc here\n")
    corpus = text_corpora.load_corpus("local", data_dir=tmp_path)
    assert corpus.documents == [
        "first doc line one\nline two", "second doc", "third", "fourth doc here",
    ]  # fmt: skip
    assert corpus.sources.tolist() == ["a.txt", "a.txt", "sub/b.txt", "sub/b.txt"]
    tok = _WordTokenizer()
    units = text_corpora.tokenize_corpus(corpus, tok, "document", cache_dir=tmp_path / "c")
    assert [u.tolist() for u in units.ids][:2] == [[15, 13, 14, 13, 14, 13], [16, 13]]
    again = text_corpora.tokenize_corpus(corpus, tok, "document", cache_dir=tmp_path / "c")
    assert tok.calls == 1 and [u.tolist() for u in again.ids] == [u.tolist() for u in units.ids]
    lines = text_corpora.tokenize_corpus(corpus, tok, "line", cache_dir=tmp_path / "c")
    assert lines.document.tolist() == [0, 0, 1, 2, 3] and tok.calls == 2
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no \\*.txt files"):
        text_corpora.load_corpus("local", data_dir=tmp_path / "empty")


def test_hub_path_reads_a_text_column_with_datasets(tmp_path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    data = tmp_path / "mytext"
    (data / "data").mkdir(parents=True)
    pq.write_table(pa.table({"text": ["one doc", "", "two doc"], "id": [1, 2, 3]}),
                   data / "data" / "train-00000-of-00001.parquet")  # fmt: skip
    corpus = text_corpora.load_corpus(f"hub:{data}")
    assert corpus.documents == ["one doc", "two doc"] and corpus.sources.tolist() == ["train"] * 2
    with pytest.raises(UserError, match="could not load"):
        text_corpora.load_corpus(f"hub:{tmp_path / 'nothing-here'}")
    pq.write_table(pa.table({"body": ["x"]}), data / "data" / "train-00000-of-00001.parquet")
    with pytest.raises(UserError, match="no 'text' column"):
        text_corpora.load_corpus(f"hub:{data}")


def test_pubmed_from_a_data_dir_and_unknown_names(tmp_path) -> None:
    xml = (
        "<PubmedArticleSet><PubmedArticle><MedlineCitation><PMID>1</PMID><Article><Abstract>"
        "<AbstractText>An abstract.</AbstractText></Abstract><Language>eng</Language></Article>"
        "</MedlineCitation></PubmedArticle></PubmedArticleSet>"
    )
    (tmp_path / "pubmed01.xml").write_text(xml)
    corpus = text_corpora.load_corpus("pubmed", data_dir=tmp_path, cache_dir=tmp_path / "c")
    assert corpus.documents == ["An abstract."] and corpus.sources.tolist() == ["pubmed01.xml"]
    for bad in ("wiki", "hub:"):
        with pytest.raises(UserError, match="unknown corpus"):
            text_corpora.check_corpus_name(bad)
    with pytest.raises(UserError, match="does not exist"):
        text_corpora.load_corpus("local", data_dir=tmp_path / "nope")
    assert (
        TextCorpus("x", ["a"], np.array(["s"])).fingerprint()
        != TextCorpus("x", ["a"], np.array(["t"])).fingerprint()
    )


def test_sequences_document_stream_and_lines() -> None:
    ids = [np.arange(1, 8, dtype=np.int32) + 10 * d for d in range(3)]  # docs of 7 tokens
    units = TextUnits(ids, np.arange(3))
    kw = {"max_length": 6, "cls_id": 101, "sep_id": 102, "pad_id": 0}
    seqs = text_corpora.sequences(units, [2, 0], mode="document", **kw)
    # doc 2 then doc 0 as one stream with [SEP] between, cut into pieces of 4
    assert seqs.input_ids.tolist() == [
        [101, 21, 22, 23, 24, 102], [101, 25, 26, 27, 102, 102],
        [101, 1, 2, 3, 4, 102], [101, 5, 6, 7, 102, 0],
    ]  # fmt: skip
    assert seqs.lengths.tolist() == [6, 6, 6, 5]
    assert seqs.attention_mask[-1].tolist() == [1, 1, 1, 1, 1, 0]
    lines = TextUnits([np.array([5, 6], np.int32), np.array([7] * 9, np.int32)], np.array([0, 0]))
    out = text_corpora.sequences(lines, [0], mode="line", **kw)
    assert out.input_ids.tolist() == [[101, 5, 6, 102, 0, 0], [101, 7, 7, 7, 7, 102]]
    assert text_corpora.units_of(units, np.array([1, 2])).tolist() == [1, 2]
