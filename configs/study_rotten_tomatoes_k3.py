# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Study preset (docs/results.md): rotten tomatoes, MiniLM-L6, K=3, Table I "other" row (80/20, 50/50, 20/80).

Sized so that FedAvg learns on a 2-core CPU (docs/benchmarks.md has the run times): 4,000 of the
12,808 snippets subsampled, exact Table I shares (3,429 used: 914 train + 229 test per client, the
surplus dropped), 10 rounds of 1 local epoch.

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
        max_examples=4000,
        rounds=10,
        local_epochs=1,
        batch_size=16,
        lr=5e-5,
        max_length=64,
        chunk_size=1,
        checkpoint_every=2,  # a study run resumes from its last checkpoint
        eval_every=1,
    )
