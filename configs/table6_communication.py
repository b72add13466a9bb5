# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Paper Table VI / Fig. 6: bytes per round and to reach 84% accuracy on MRPC (K=3, c=6).

  python -m fedjax_split.train --config configs/table6_communication.py --critical-layer L --output-dir runs/t6_fedavg
  python -m fedjax_split.train --config configs/table6_communication.py --critical-layer L --algorithm fedadam --output-dir runs/t6_fedadam
  python -m fedjax_split.train --config configs/table6_communication.py --output-dir runs/t6_fedsplit
  python -m fedjax_split.train --config configs/table6_communication.py --quantize fp16 --output-dir runs/t6_fedsplit16
  python tools/plot.py runs/t6_* --metric accuracy --out plots/t6

metrics.jsonl holds bytes_up/bytes_down per round and the cumulative bytes; the plot's
"vs cumulative MB" panel is Fig. 6.
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
        eval_every=1,
    )
