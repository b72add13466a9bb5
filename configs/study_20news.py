# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Study preset (docs/results.md): 20 Newsgroups, MiniLM-L6, FedNLP's cross-device regime.

100 clients, Dirichlet label skew alpha = 1, 10 clients sampled per round, the whole corpus (18,821
documents, about 188 per client), 22 rounds of 1 local epoch (FedNLP's FedAvg reaches 0.51 on the
global test set at round 22 with DistilBERT), 128 tokens; evaluated every 4 rounds and after the
last. With nothing local (--critical-layer 6) the record's `pooled` is FedNLP's figure: the global
model on the union of the clients' test data. Sized for a 2-core CPU (docs/benchmarks.md has the
run times).

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
        rounds=22,
        local_epochs=1,
        batch_size=16,
        lr=5e-5,
        max_length=128,
        chunk_size=1,
        checkpoint_every=1,  # a study run resumes from its last checkpoint
        eval_every=4,  # evaluating 100 clients costs most of a round
    )
