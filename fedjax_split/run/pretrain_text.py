"""Further pre-training's text, from the config: the corpus tokenised and split over the clients
(or each site's own *.txt, read where it lives), cut into sequences, and the held-out text as
masked batches whose masks come from the seed alone (a site's from the seed and its id)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedjax_split.data.text import corpus_split, mlm_batching, text_corpora
from fedjax_split.errors import UserError
from fedjax_split.run.pretrain_config import (
    PretrainConfig,
)
from fedjax_split.run.sites import site_dirs

HELDOUT = 0x7FFF_FFFF  # the "client" part of the held-out masks' seed: no client has this id
def load_split(config: PretrainConfig, tokenizer: Any) -> tuple[Any, Any]:
    """(the corpus' token units, its split): the corpus tokenised, its documents over the
    clients, the held-out documents on none."""
    corpus = text_corpora.load_corpus(config.data.corpus, data_dir=config.data.data_dir)
    units = text_corpora.tokenize_corpus(corpus, tokenizer, config.data.text_mode)
    split = corpus_split.split_corpus(
        corpus.sources,
        scheme=config.data.split,
        num_clients=config.federation.clients,
        seed=config.seed,
        heldout_fraction=config.data.heldout_fraction,
        sigma=config.data.sigma,
        max_documents=config.data.max_documents,
    )
    return units, split


def text_sequences(config: PretrainConfig, tokenizer: Any, units: Any, docs: Any) -> Any:
    """The sequences of documents `docs` (a client's, or the held-out ones)."""
    return text_corpora.sequences(
        units, docs, mode=config.data.text_mode, max_length=config.data.max_length,
        cls_id=tokenizer.cls_token_id, sep_id=tokenizer.sep_token_id,
        pad_id=tokenizer.pad_token_id,
    )  # fmt: skip


def check_has_text(client: int, seqs: Any, site: bool = False) -> None:
    if seqs.input_ids.shape[0] == 0:
        raise UserError(
            f"site {client} has no text to train on; give it more *.txt text" if site else
            f"client {client} has no text; use more documents or fewer --clients"
        )  # fmt: skip


def heldout_batches(
    config: PretrainConfig, seqs: Any, spec: Any, pad_id: int, site: int | None = None
) -> list[Any]:
    """The masked held-out batches (their masks seeded by the seed alone, or for a site's own
    held-out text by the seed and its client id)."""
    seed = [config.seed, 0, HELDOUT] + ([] if site is None else [int(site)])
    return mlm_batching.eval_batches(
        seqs, batch_size=min(config.client.batch_size, 64), masking=spec, seed=seed, pad_id=pad_id
    )


def site_documents(config: PretrainConfig, client: int, site_dir: Any) -> tuple[Any, Any, Any]:
    """(site `client`'s corpus, its training documents, its held-out documents): the *.txt
    under `site_dir` read as --corpus local reads --data-dir, a problem named by the site. No
    tokenizer: the Flower launcher checks every site with it before it starts a process."""
    try:
        corpus = text_corpora.load_corpus("local", data_dir=site_dir)
        train, held = corpus_split.site_heldout(
            len(corpus), client=client, seed=config.seed,
            heldout_fraction=config.data.heldout_fraction,
        )
    except UserError as err:
        raise UserError(f"site {client} ({site_dir}): {err}") from None
    return corpus, train, held


def site_text(
    config: PretrainConfig, tokenizer: Any, spec: Any, client: int, site_dir: Any
) -> tuple[dict[str, int], Any, list[Any]]:
    """Site `client`'s part of the run, computed where its text lives (its SuperNode, or the
    simulation for every site in turn), from its own files alone: (its counts for split.json,
    its training sequences, its held-out masked batches)."""
    corpus, train, held = site_documents(config, client, site_dir)
    units = text_corpora.tokenize_corpus(corpus, tokenizer, config.data.text_mode)
    seqs = text_sequences(config, tokenizer, units, train)
    check_has_text(client, seqs, site=True)
    held_seqs = text_sequences(config, tokenizer, units, held)
    heldout = heldout_batches(config, held_seqs, spec, int(tokenizer.pad_token_id), site=client)
    return corpus_split.site_counts(train, held), seqs, heldout


def sites_text(config: PretrainConfig, tokenizer: Any, spec: Any) -> tuple[Any, ...]:
    """--site-data in one process: `client_text`'s tuple from every site's `site_text` in
    client order; the held-out batches are the sites' own, site 0's first (the order in which
    Flower's server adds up the sites' figures); centralised training holds every site's
    training sequences on one client."""
    dirs = site_dirs(config)
    if not dirs:
        raise UserError(f"--site-data {config.data.site_data}: the simulation reads every site "
                        "itself; pass the sites' directories DIR0,DIR1,...")  # fmt: skip
    parts = [site_text(config, tokenizer, spec, k, d) for k, d in enumerate(dirs)]
    split = corpus_split.SitesSplit(tuple(p[0] for p in parts), config.seed)
    seqs = [p[1] for p in parts]
    heldout = [batch for p in parts for batch in p[2]]
    if config.federation.method == "centralised":
        joined = text_corpora.Sequences(np.concatenate([s.input_ids for s in seqs]),
                                        np.concatenate([s.lengths for s in seqs]))  # fmt: skip
        return split, [0], [joined], heldout
    return split, list(range(len(dirs))), seqs, heldout


def client_text(config: PretrainConfig, tokenizer: Any, spec: Any) -> tuple[Any, ...]:
    """(the split, the training clients, their sequences, the held-out masked batches): the
    corpus tokenised and cut into sequences, documents over the clients (all of it on one client
    for centralised training), the held-out documents on none; with --site-data, each site's own
    (`sites_text`)."""
    if config.data.site_data is not None:
        return sites_text(config, tokenizer, spec)
    units, split = load_split(config, tokenizer)
    make = lambda docs: text_sequences(config, tokenizer, units, docs)  # noqa: E731
    if config.federation.method == "centralised":
        clients, seqs = [0], [make(np.concatenate(split.clients))]
    else:
        clients, seqs = list(range(config.federation.clients)), [make(d) for d in split.clients]
    for c, s in zip(clients, seqs, strict=True):
        check_has_text(c, s)
    heldout = heldout_batches(config, make(split.heldout), spec, tokenizer.pad_token_id)
    return split, clients, seqs, heldout
