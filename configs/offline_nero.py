# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Offline preset: biomedical NER (NERO, BIO derived from its mention annotations, the 8 most
frequent classes; see fedjax_split/data/tokens/ner_corpora.py) with MiniLM-L6, 3 non-IID clients.

  python -m fedjax_split.train --config configs/offline_nero.py
  python -m fedjax_split.train --config configs/offline_nero.py --max-examples 6000 --rounds 5
"""


def get_config() -> dict:
    return dict(
        task="nero",
        model="minilm-l6",
        critical_layer=3,
        partition="dirichlet",  # alpha 1, the default
        local_epochs=1,
        lr=1e-4,
    )
