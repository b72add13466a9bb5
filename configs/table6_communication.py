# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Paper Table VI / Fig. 6: bytes per round and to reach 84% accuracy on MRPC (K=3, c=6).

  python -m fedjax_split.train --config configs/table6_communication.py --critical-layer L --output-dir runs/t6_fedavg
  python -m fedjax_split.train --config configs/table6_communication.py --critical-layer L --algorithm fedadam --output-dir runs/t6_fedadam
  python -m fedjax_split.train --config configs/table6_communication.py --output-dir runs/t6_fedsplit
  python -m fedjax_split.train --config configs/table6_communication.py --quantize fp16 --output-dir runs/t6_fedsplit16
  python tools/plot.py runs/t6_* --metric accuracy --out plots/t6

The paper's per-round figures (1.03 GB for FedAvg, 0.51 GB at c=6) are the upload only, of the
encoder layers only: 3 clients x 4 B x 85.6M (12 layers + pooler) and x 42.5M (6 layers). The
embeddings are frozen here (`freeze`), so nothing of theirs is trained or sent, and each round's
`bytes_up` in metrics.jsonl is the paper's figure (bytes_down the same download); drop the
freeze (`--freeze ''`) to train and send the embeddings too.
The plot's "vs cumulative MB" panel is Fig. 6. Every other setting is the default (evaluated
every round).
"""


def get_config() -> dict:
    return dict(task="mrpc", freeze=r"embeddings\.")
