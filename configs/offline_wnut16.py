# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Offline preset: Twitter NER (WNUT-16 train, Ritter et al.; 10 entity types, BIO) with MiniLM-L6.

Token classification: each word's tag on its first sub-word, entity-level F1 (strict IOB2, as
seqeval). Clients are non-IID by each tweet's most frequent entity type (Dirichlet, alpha 1).

  python -m fedjax_split.train --config configs/offline_wnut16.py
  python -m fedjax_split.train --config configs/offline_wnut16.py --critical-layer L
"""


def get_config() -> dict:
    return dict(
        task="wnut16",
        model="minilm-l6",
        critical_layer=3,
        partition="dirichlet",  # alpha 1, the default
        local_epochs=2,
        lr=1e-4,
    )
