"""Document splits of a text corpus: held-out text on no client, IID, quantity skew with
normal-distributed sizes, by source; reproducible from the seed; one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

from fedjax_split.data.text.corpus_split import split_corpus
from fedjax_split.errors import UserError

SOURCES = np.array(["old.xml.gz"] * 120 + ["new.xml.gz"] * 180)


def _check_disjoint_cover(split, n: int) -> None:
    parts = [*split.clients, split.heldout]
    allof = np.concatenate(parts)
    assert allof.size == np.unique(allof).size == n
    assert all((np.diff(p) > 0).all() for p in parts)  # sorted


@pytest.mark.parametrize("scheme", ["iid", "quantity", "source"])
def test_every_document_once_and_the_seed_reproduces(scheme) -> None:
    split = split_corpus(SOURCES, scheme=scheme, num_clients=4, seed=3)
    _check_disjoint_cover(split, 300)
    assert split.heldout.size == 15  # 5% held out
    again = split_corpus(SOURCES, scheme=scheme, num_clients=4, seed=3)
    assert [c.tolist() for c in again.clients] == [c.tolist() for c in split.clients]
    other = split_corpus(SOURCES, scheme=scheme, num_clients=4, seed=4)
    assert [c.tolist() for c in other.clients] != [c.tolist() for c in split.clients]


def test_iid_and_quantity_sizes() -> None:
    assert split_corpus(SOURCES, scheme="iid", num_clients=4, seed=0).sizes() == [72, 71, 71, 71]
    sizes = np.array([split_corpus(SOURCES, scheme="quantity", num_clients=6, seed=s).sizes()
                      for s in range(200)])  # fmt: skip
    assert (sizes.sum(1) == 285).all() and sizes.min() >= 1
    relative = sizes / sizes.mean(1, keepdims=True)
    assert 0.35 < relative.std() < 0.6  # sigma 0.5 (clipping at 0.05 trims the low tail)
    assert split_corpus(SOURCES, scheme="quantity", num_clients=6, seed=0, sigma=0.0).sizes() == [
        48, 48, 48, 47, 47, 47,
    ]  # fmt: skip


def test_by_source_and_subsample() -> None:
    split = split_corpus(SOURCES, scheme="source", num_clients=4, seed=0)
    names = sorted(set(SOURCES))  # new, old
    for i, c in enumerate(split.clients):
        assert set(SOURCES[c]) == {names[i % 2]}
    small = split_corpus(SOURCES, scheme="iid", num_clients=2, seed=0, max_documents=40)
    assert sum(small.sizes()) + small.heldout.size == 40
    assert small.to_dict()["clients"] == [c.tolist() for c in small.clients]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"scheme": "dirichlet"}, "unknown split"),
        ({"num_clients": 0}, "--clients"),
        ({"num_clients": 300}, "cannot give 300 clients"),
        ({"scheme": "source", "num_clients": 1}, "one client per source"),
        ({"heldout_fraction": 1.0}, "--heldout-fraction"),
    ],
)
def test_bad_settings(kwargs, needle) -> None:
    settings = {"scheme": "iid", "num_clients": 3, "seed": 0, **kwargs}
    with pytest.raises(UserError, match=needle):
        split_corpus(SOURCES, **settings)
