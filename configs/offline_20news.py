# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Offline preset: 20 Newsgroups (20 classes, FedNLP's benchmark) with MiniLM-L6, Dirichlet skew.

FedNLP's setting is 100 clients, 10 per round, alpha = 1; this preset is a CPU-sized version.

  python -m fedjax_split.train --config configs/offline_20news.py
  python -m fedjax_split.train --config configs/offline_20news.py --clients 100 --clients-per-round 10 --rounds 22
"""


def get_config() -> dict:
    return dict(
        task="20news",
        model="minilm-l6",
        critical_layer=3,
        clients=10,
        clients_per_round=5,
        partition="dirichlet",  # alpha 1, the default
        local_epochs=1,
        lr=5e-5,
    )
