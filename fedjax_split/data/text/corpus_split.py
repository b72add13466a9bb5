"""Which documents of a text corpus each client holds, and which are held out for evaluation.

A corpus is split by document (a document's text stays on one client). First an optional
uniform subsample (`max_documents`), then the held-out documents (`heldout_fraction` of them, at
least one; the server's evaluation text, on no client), then the rest over the clients:
- "iid": a uniform random split into K parts of equal size (to one document);
- "quantity": quantity skew as FedBFPT's skewed setting describes it, client sizes from a normal
  distribution: weights w_i ~ N(1, sigma), clipped below at 0.05, sizes proportional to w_i
  (largest remainders; every client gets at least one document);
- "source": by where the text came from (PubMed's two baseline files, decades apart; a local
  corpus' files): client i takes documents of source i mod S (S sources, K >= S), each source's
  documents split uniformly among its clients.
Randomness: `np.random.default_rng([seed, 0, purpose])` objects only.

Sites with their own text (`--site-data`) are not split from one corpus: site k's documents are
client k's. Each site holds out `heldout_fraction` of its own documents (`site_heldout`, drawn
from the seed and its client id alone, so that it needs nothing of the other sites), and
`SitesSplit` records each site's counts only: no text, no paths, nothing a site would not say.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fedjax_split.errors import UserError

SCHEMES = ("iid", "quantity", "source")
SITES = "sites"  # split.json's scheme for sites with their own text
_SUBSAMPLE, _HELDOUT, _CLIENTS, _SITE_HELDOUT = 11, 12, 13, 14  # `purpose` parts of the seeds


@dataclasses.dataclass(frozen=True)
class CorpusSplit:
    """Document ids (sorted) of each client and of the held-out text."""

    clients: tuple[np.ndarray, ...]
    heldout: np.ndarray
    scheme: str
    seed: int

    def sizes(self) -> list[int]:
        return [int(c.size) for c in self.clients]

    def to_dict(self) -> dict:
        return {
            "scheme": self.scheme,
            "seed": self.seed,
            "clients": [c.tolist() for c in self.clients],
            "heldout": self.heldout.tolist(),
        }


def _equal_parts(ids: np.ndarray, parts: int) -> list[np.ndarray]:
    return [np.sort(p) for p in np.array_split(ids, parts)]


def _quantity_sizes(n: int, k: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    weights = np.maximum(rng.normal(1.0, sigma, size=k), 0.05)
    spare = n - k  # one document each first, the rest in proportion to the weights
    share = weights / weights.sum() * spare
    sizes = np.floor(share).astype(np.int64)
    left = spare - int(sizes.sum())
    sizes[np.argsort(-(share - sizes), kind="stable")[:left]] += 1
    return sizes + 1


def split_corpus(
    sources: np.ndarray,
    *,
    scheme: str,
    num_clients: int,
    seed: int,
    heldout_fraction: float = 0.05,
    sigma: float = 0.5,
    max_documents: int | None = None,
) -> CorpusSplit:
    """Splits documents 0..N-1 (with their `sources`) as the module docstring says."""
    if scheme not in SCHEMES:
        raise UserError(f"unknown split {scheme!r}; use one of {', '.join(SCHEMES)}")
    if num_clients < 1:
        raise UserError(f"--clients must be at least 1, got {num_clients}")
    if not 0.0 < heldout_fraction < 1.0:
        raise UserError(f"--heldout-fraction must be in (0, 1), got {heldout_fraction}")
    sources = np.asarray(sources).astype(str)
    docs = np.arange(sources.size, dtype=np.int64)
    if max_documents is not None and max_documents < docs.size:
        pick = np.random.default_rng([seed, 0, _SUBSAMPLE]).choice(docs.size, max_documents, False)
        docs = np.sort(pick)
    n_held = max(1, int(round(heldout_fraction * docs.size)))
    if docs.size - n_held < num_clients:
        raise UserError(
            f"{docs.size} documents ({n_held} held out) cannot give {num_clients} clients one "
            "each; use more documents (--max-documents) or fewer --clients"
        )
    shuffled = np.random.default_rng([seed, 0, _HELDOUT]).permutation(docs)
    heldout, rest = np.sort(shuffled[:n_held]), shuffled[n_held:]
    rng = np.random.default_rng([seed, 0, _CLIENTS])
    rest = rng.permutation(np.sort(rest))
    if scheme == "iid":
        clients = _equal_parts(rest, num_clients)
    elif scheme == "quantity":
        if not (np.isfinite(sigma) and sigma >= 0):
            raise UserError(f"--sigma must be >= 0, got {sigma}")
        sizes = _quantity_sizes(rest.size, num_clients, sigma, rng)
        clients = [np.sort(p) for p in np.split(rest, np.cumsum(sizes)[:-1])]
    else:
        names = sorted(set(sources[rest].tolist()))
        if num_clients < len(names):
            raise UserError(
                f"--split source needs at least one client per source ({len(names)} sources: "
                f"{', '.join(names[:4])}), got --clients {num_clients}"
            )
        clients = [np.zeros(0, np.int64)] * num_clients
        for s, name in enumerate(names):
            owners = list(range(s, num_clients, len(names)))
            mine = rest[sources[rest] == name]
            if mine.size < len(owners):
                raise UserError(
                    f"source {name!r} has {mine.size} documents for {len(owners)} clients; use "
                    "more documents or fewer --clients"
                )
            for owner, part in zip(owners, _equal_parts(mine, len(owners)), strict=True):
                clients[owner] = part
    return CorpusSplit(tuple(clients), heldout, scheme, seed)


def site_heldout(
    num_documents: int, *, client: int, seed: int, heldout_fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) document ids (sorted) of one site's own documents 0..n-1: a
    `heldout_fraction` of them, at least one and never all, drawn from
    `default_rng([seed, 0, _SITE_HELDOUT, client])`, so that every site draws its own part
    where it lives and the simulation draws the same."""
    if not 0.0 < heldout_fraction < 1.0:
        raise UserError(f"--heldout-fraction must be in (0, 1), got {heldout_fraction}")
    n = int(num_documents)
    n_held = max(1, int(round(heldout_fraction * n)))
    if n - n_held < 1:
        raise UserError(
            f"site {client} has {n} document(s), {n_held} held out, none left to train on; give "
            "it more documents (blank lines separate them) or lower --heldout-fraction"
        )
    shuffled = np.random.default_rng([int(seed), 0, _SITE_HELDOUT, int(client)]).permutation(n)
    return np.sort(shuffled[n_held:]), np.sort(shuffled[:n_held])


def site_counts(train: np.ndarray, heldout: np.ndarray) -> dict[str, int]:
    """What split.json says of one site: its documents, those it trains on, those it holds out."""
    return {"documents": int(train.size + heldout.size), "train": int(train.size),
            "heldout": int(heldout.size)}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SitesSplit:
    """Sites with their own text: each site's `site_counts`, in client order (split.json)."""

    sites: tuple[dict[str, int], ...]
    seed: int

    def sizes(self) -> list[int]:
        return [int(s["train"]) for s in self.sites]

    def to_dict(self) -> dict:
        return {"scheme": SITES, "seed": self.seed, "sites": [dict(s) for s in self.sites]}
