# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Study preset (issue 6): rotten tomatoes, MiniLM-L6, K=3, Table I "other" row (80/20, 50/50, 20/80).

CPU-sized: 600 examples (200 per client, 160 train / 40 test), 4 rounds of 2 local epochs.

  python -m fedjax_split.train --config configs/study_rotten_tomatoes_k3.py --output-dir runs/study/k3_fedsplit_c3
"""


def get_config() -> dict:
    return dict(
        task="rotten_tomatoes",
        model="minilm-l6",
        algorithm="fedavg",
        critical_layer=3,
        clients=3,
        partition="paper",
        max_examples=600,
        rounds=4,
        local_epochs=2,
        batch_size=16,
        lr=5e-5,
        max_length=64,
        chunk_size=1,
        checkpoint_every=0,
        eval_every=1,
    )
