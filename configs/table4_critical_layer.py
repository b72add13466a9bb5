# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Paper Table IV: FedSplitBERT by critical layer c (K=3, bert-base-uncased), one run per (task, c).

  for c in 0 4 6 8 10 12; do
    python -m fedjax_split.train --config configs/table4_critical_layer.py --task mrpc \
        --critical-layer $c --output-dir runs/t4_mrpc_c$c
  done

c=12 is FedAvg (everything global), c=0 is local training only (nothing is sent). Average the
primary metric of summary.json over the 9 GLUE tasks to get the table's row; tools/plot.py draws
the runs side by side.
"""


def get_config() -> dict:
    return dict(
        task="mrpc",
        model="bert-base-uncased",
        algorithm="fedavg",
        critical_layer=6,
        clients=3,
        partition="paper",
        rounds=10,
        local_epochs=3,
        batch_size=16,
        lr=2e-5,
        max_length=128,
    )
