# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Study preset (issue 6): 20 Newsgroups, MiniLM-L6, FedNLP's cross-device regime.

100 clients, Dirichlet label skew alpha = 1, 10 clients sampled per round. CPU-sized: 2,000 of the
18,821 documents (about 20 per client), 4 rounds of 2 local epochs, 128 tokens.

  python -m fedjax_split.train --config configs/study_20news.py --output-dir runs/study/news_fedsplit_c3
"""


def get_config() -> dict:
    return dict(
        task="20news",
        model="minilm-l6",
        algorithm="fedavg",
        critical_layer=3,
        clients=100,
        clients_per_round=10,
        partition="dirichlet",
        alpha=1.0,
        max_examples=2000,
        rounds=4,
        local_epochs=2,
        batch_size=16,
        lr=5e-5,
        max_length=128,
        chunk_size=1,
        checkpoint_every=0,
        eval_every=1,
    )
