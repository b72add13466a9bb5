# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Offline preset: TREC question type (6 coarse labels, 5.5k questions) with MiniLM-L6.

python -m fedjax_split.train --config configs/offline_trec.py
python -m fedjax_split.train --config configs/offline_trec.py --critical-layer 5 --alpha 0.3
"""


def get_config() -> dict:
    return dict(
        task="trec",
        model="minilm-l6",
        critical_layer=3,
        clients=5,
        partition="dirichlet",
        alpha=0.5,
        rounds=8,
        local_epochs=2,
        lr=5e-5,
        max_length=64,
    )
