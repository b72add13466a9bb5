# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Paper Table V: K=10 clients (Table II partition), accuracy on QQP, SST-2, QNLI and MRPC.

Rounds per task as in the paper: MRPC 6, SST-2 9, QQP and QNLI 3.

  python -m fedjax_split.train --config configs/table5_k10.py --output-dir runs/t5_sst2_fedsplit
  python -m fedjax_split.train --config configs/table5_k10.py --task mrpc --rounds 6 --output-dir runs/t5_mrpc_fedsplit
  python -m fedjax_split.train --config configs/table5_k10.py --task qqp --rounds 3 --output-dir runs/t5_qqp_fedsplit
  python -m fedjax_split.train --config configs/table5_k10.py --task qnli --rounds 3 --output-dir runs/t5_qnli_fedsplit

Baseline rows: add --critical-layer L [--algorithm fedprox|fedadam]; the +16-bit row: --quantize fp16.
"""


def get_config() -> dict:
    return dict(
        task="sst2",
        model="bert-base-uncased",
        algorithm="fedavg",
        critical_layer=6,
        clients=10,
        partition="paper",
        rounds=9,
        local_epochs=3,
        batch_size=16,
        lr=2e-5,
        max_length=128,
    )
